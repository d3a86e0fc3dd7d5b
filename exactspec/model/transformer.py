"""The transformer: Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 / Qwen3-MoE, forward over flattened rows.

A forward call takes any set of rows (token, slot, position) from any sequences: a prompt, one
decode token, k+1 verify tokens, or all of these from many sequences at once. Every row is
computed by batch-invariant kernels (exactspec.kernels), so the logits of a row are a function of its
sequence's tokens up to its position and the weights, nothing else.

`forward` runs the whole model as one compiled call (forward.py) on the stacked weights;
`forward_ref` is its readable twin, one kernel call per step, and gives the same bits.
Weights come from a HF folder (weights.TensorStore) or a GGUF file (gguf_file.GGUFFile).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from .. import kernels as K
from ..errors import UnsupportedModelError
from . import forward as F
from .stack import Layer, Stack
from .cache import KVCache, block_bytes
from .config import Limits, ModelConfig
from .memory import ensure_fits
from .pack import ACTIVATIONS, DTYPES, Packer
from .weights import TensorStore



def int64s(xs) -> torch.Tensor:
    """A list of ints as an int64 tensor (4x cheaper than torch.tensor for the decode loop's short lists)."""
    return torch.from_numpy(np.array(xs, np.int64))


class Rows:
    """The rows of one forward, flattened: (token, slot, position) each, and the rows whose logits
    are wanted. Any mix of prompts, decode tokens and verify chunks of many sequences."""

    def __init__(self) -> None:
        self.tok: list[int] = []
        self.slot: list[int] = []
        self.pos: list[int] = []
        self.out: list[int] = []  # indexes into the rows above, in the order the logits come back

    def add(self, slot: int, tokens: Sequence[int], start: int, logits_from: int | None = None) -> None:
        """`tokens` of the sequence in `slot` at positions start, start + 1, ...; the logits of the
        last of them (None), or of tokens[logits_from:] (0: every one, a verify chunk; scoring)."""
        first = len(self.tok)
        self.tok += tokens
        self.slot += [slot] * len(tokens)
        self.pos += range(start, start + len(tokens))
        self.out += [len(self.tok) - 1] if logits_from is None else range(first + logits_from, len(self.tok))

    def forward(self, net: "Transformer", cache: KVCache, x_in: np.ndarray | None = None,
                hidden: np.ndarray | None = None) -> torch.Tensor:
        """(len(out), V) float32 logits; writes every row's keys and values into `cache`. x_in, hidden:
        see Transformer.forward."""
        return net.forward(int64s(self.tok), int64s(self.slot), int64s(self.pos), cache, int64s(self.out), x_in, hidden)


def rope_frequencies(theta: float, d: int) -> np.ndarray:
    """theta^(-2i/d) for i < d/2, float32, unscaled (`inv_freq`)."""
    return np.float32(1.0) / K.pow_rope(theta, np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d))


def inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """RoPE inverse frequencies (D/2,) float32: theta^(-2i/D), divided by each frequency's factor where
    the RoPE is scaled. theta^(2i/D) is our own float32 pow (kernels/powf.py: the bits torch's vectorized pow
    gave on AVX2 and AVX-512, now on every CPU). Llama 3.x's factors are the ones llama.cpp's converter writes
    into a GGUF file's rope_freqs tensor (`llama3_factors`), so a HF folder and its GGUF give the same bits
    (transformers scales the frequencies by the same formula in another order: ~1 ulp apart in the blended
    band). Every other step is one IEEE float32 operation, as torch did them (tests/model/test_rope.py keeps
    the torch version as the twin). local: the windowed layers' own table (Gemma 3: rope_local_theta, never
    scaled)."""
    f = rope_frequencies(cfg.rope_local_theta if local else cfg.rope_theta, cfg.head_dim)
    s = cfg.rope_scaling
    if s is None or local:
        return f
    if "linear" in s:
        return f / np.float32(s["linear"])
    factors = np.asarray(s["freq_factors"], np.float32) if "freq_factors" in s else llama3_factors(f, s)
    return f / factors


def llama3_factors(f: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.x's divisor of each frequency f (float32 arithmetic): 1 for short wavelengths, `factor`
    for long ones, and between them 1 / ((1 - smooth) / factor + smooth), smooth rising linearly in
    original_max_position_embeddings / wavelength from low_freq_factor to high_freq_factor. (Each Python
    number meets the float32 array as a float32, as in torch.)"""
    F32 = np.float32
    ctx, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                              s["factor"])
    wl = F32(2 * math.pi) / f
    smooth = (F32(ctx) / wl - F32(low)) / F32(high - low)
    blended = F32(1) / ((F32(1) - smooth) / F32(factor) + smooth)
    return np.where(wl < F32(ctx / high), F32(1), np.where(wl > F32(ctx / low), F32(factor), blended)).astype(F32)


ROPE_START = 1024  # positions the RoPE tables cover at load (they grow as positions demand)


class Transformer:
    kv_dtype = "float32"  # how its KV caches store keys and values ("bfloat16": half the memory; api.load)

    def __init__(self, cfg: ModelConfig, store: TensorStore, dtype: str, max_context: int, quant: str = "none",
                 activations: str = "int8"):
        """quant: "none", "keep" or a quantizer; activations: "int8" or "float32" (see pack.Packer)."""
        if dtype not in DTYPES:
            raise UnsupportedModelError(f"dtype={dtype!r} is not supported (float32, bfloat16)")
        if activations not in ACTIVATIONS:
            raise UnsupportedModelError(f"activations={activations!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.cfg = cfg
        self.max_context = max_context
        H, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        local = cfg.rope_local_theta is not None
        ensure_fits(2 * (1 + local) * max_context * D * 4, f"RoPE tables for max_context={max_context}", "max_context")
        if cfg.n_layers < 1:
            raise UnsupportedModelError(f"num_hidden_layers={cfg.n_layers}: at least one layer is needed")
        if Hq % Hkv:
            raise UnsupportedModelError(f"num_attention_heads={Hq} is not a multiple of num_key_value_heads={Hkv}")

        p = Packer(cfg, store, dtype, quant, activations)
        embed = p.embed()
        st = None
        for i in range(cfg.n_layers):
            layer = p.layer(i)
            if st is None:  # one copy of the weights: packed layer by layer into the stack
                st = Stack.empty(layer, p.layouts(), cfg.n_layers, cfg.n_experts_used or 1)
            st.put(i, layer)
        self.stack = st
        self.layers: list[Layer] = [st.views(i) for i in range(cfg.n_layers)]
        self.norm = p.norm("model.norm.weight", H)
        self.lm_head = p.head(embed)
        self.dtype = p.name()  # e.g. "q4_1+q8_0+float32": the formats kept, then the rest
        # what quantized weights multiply: int8 rows (integer dot products) or float32 ones
        self.activations = activations if any(p.fmt.values()) else "float32"
        self._rope_kinds = (False, True) if local else (False,)  # the global table, then the local one
        self._grow_rope(min(max_context, ROPE_START))
        self.windows = np.array(cfg.windows(), np.int64)  # each layer's window (0: none)
        self.rope_of = np.array(cfg.rope_tables(), np.int64)  # each layer's table
        self.scale = cfg.query_scale if cfg.query_scale is not None else 1.0 / math.sqrt(D)
        self.gated = K.GEGLU if cfg.act == "gelu_tanh" else K.SWIGLU
        if isinstance(embed, K.PackedWeight):
            self._embed_np = embed.data  # F.embed_rows reads row t from lane t % NL of block t // NL
        else:
            e = embed.contiguous()
            self._embed_np = K.as_numpy(e)
        # Weights are read-only from here on (the kernels never write them). Also one numba type for
        # every way a model is made: arrays from Ray's object store are read-only, and a read-only
        # array is a different type to numba (another compile) than a writable one.
        for arr in [*self.stack.arrays.values(), self.norm, self.lm_head.data, self.lm_head.bias, self._embed_np]:
            arr.flags.writeable = False

    def __getstate__(self) -> dict:
        # For Ray's object store (exactspec.serve.ray): the stacked arrays travel once, zero-copy; the
        # per-layer views and a lookup table that is a view of the tied head are rebuilt from them.
        s = dict(self.__dict__)
        del s["layers"]
        if np.may_share_memory(self._embed_np, self.lm_head.data):
            s["_embed_np"] = None
        return s

    def __setstate__(self, s: dict) -> None:
        self.__dict__.update(s)
        self.layers = [self.stack.views(i) for i in range(self.cfg.n_layers)]
        if self._embed_np is None:
            self._embed_np = self.lm_head.data

    @property
    def limits(self) -> Limits:
        return Limits(self.cfg.vocab_size, self.max_context)

    def new_cache(self, n_slots: int, capacity: int, spare_blocks: int = 0, helpers: int = 0,
                  forward_only: bool = False) -> KVCache:
        """forward_only: a slot's rows never go below its last forward's first row (model/cache.py: then a
        sliding-window layer's blocks behind its window are let go)."""
        c = self.cfg
        return KVCache(c.n_layers, n_slots, c.n_kv_heads, c.head_dim, min(capacity, self.max_context), spare_blocks,
                       self.kv_dtype, helpers, self.windows, forward_only)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this model's KV cache."""
        return block_bytes(self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim, self.kv_dtype)

    def _grow_rope(self, n: int) -> None:
        """RoPE tables (T, n, D) for positions < n: made as positions demand (doubling, up to max_context),
        not for all of max_context at load (Gemma 3: 34 MB). An entry is a function of its position alone
        (kernels.rope_table), so a longer table holds the same bits for every earlier position."""
        tables = [K.rope_table(inv_freq(self.cfg, lc), n) for lc in self._rope_kinds]
        cos, sin = torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])
        self.cos, self.sin, self._cos_np, self._sin_np = cos, sin, cos.numpy(), sin.numpy()

    def _check(self, tokens: np.ndarray, pos: np.ndarray, slot: np.ndarray, cache: KVCache) -> None:
        # Not an input check (request.make_request / check_prompt do those, once): a guard for the
        # kernels, which index raw memory, against a caller of forward that broke its contract.
        if tokens.shape[0] and not (0 <= int(tokens.min()) and int(tokens.max()) < self.cfg.vocab_size
                                    and 0 <= int(pos.min()) and int(pos.max()) < cache.capacity
                                    and 0 <= int(slot.min()) and int(slot.max()) < cache.n_slots):
            raise IndexError(f"forward: rows outside the model or cache (token ids {int(tokens.min())}.."
                             f"{int(tokens.max())} of {self.cfg.vocab_size}, positions {int(pos.min())}.."
                             f"{int(pos.max())} of {cache.capacity}, slots up to {int(slot.max())} of {cache.n_slots})")
        if tokens.shape[0] and int(pos.max()) >= self._cos_np.shape[1]:
            self._grow_rope(min(self.max_context, max(int(pos.max()) + 1, 2 * self._cos_np.shape[1])))

    def forward(self, tokens: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                out_rows: torch.Tensor | None = None, x_in: np.ndarray | None = None,
                hidden: np.ndarray | None = None) -> torch.Tensor:
        """tokens, slot, pos (R,) int64 -> logits (len(out_rows) or R, V) float32, in one compiled call.

        Writes each row's keys/values into `cache` at (slot, pos); which positions are valid is the
        caller's (decode loop's) business. Bitwise equal to `forward_ref`. x_in (R, H) float32: start
        from these rows instead of the tokens' embeddings (a drafting head, decode/head.py); hidden
        (R, H) float32: filled with every row's final-normed hidden state (what the head reads).
        """
        t, s, p = tokens.numpy(), slot.numpy(), pos.numpy()
        self._check(t, p, s, cache)
        cache.reserve(s, p)
        cache.check_held(s, p)
        c = self.cfg
        rows = np.arange(t.shape[0]) if out_rows is None else out_rows.numpy()
        weights = F.Weights(self.stack, self._embed_np, self.norm, self.lm_head, self._cos_np, self._sin_np)
        shape = F.Shape(c.n_heads, c.n_kv_heads, c.head_dim, c.rms_norm_eps, self.scale, self.windows, self.rope_of,
                        self.gated, c.embed_scale, c.n_experts, c.n_experts_used, c.norm_topk)
        logits = F.forward(weights, shape, F.RowSet(t, s, p, rows),
                           F.CacheView(cache.table, K.as_numpy(cache.k), K.as_numpy(cache.v), cache.local_table,
                                       K.as_numpy(cache.local.k), K.as_numpy(cache.local.v), cache.at), x_in, hidden)
        return torch.from_numpy(logits)

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """(R, H) float32 rows of the embedding table (times embed_scale where the model scales them), as the
        compiled forward starts from them."""
        x = F.embed_rows(self._embed_np, tokens.numpy(), self.cfg.hidden_size)
        if self.cfg.embed_scale:
            x *= np.float32(self.cfg.embed_scale)
        return torch.from_numpy(x)

    def forward_ref(self, tokens: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                    out_rows: torch.Tensor | None = None, x_in: np.ndarray | None = None,
                    hidden: np.ndarray | None = None) -> torch.Tensor:
        """The readable twin of `forward` (x_in, hidden too): one kernel call per step, in data-flow order."""
        self._check(tokens.numpy(), pos.numpy(), slot.numpy(), cache)
        cache.reserve(slot.numpy(), pos.numpy())
        c = self.cfg
        R, D, Hq, Hkv = tokens.shape[0], c.head_dim, c.n_heads, c.n_kv_heads
        x = self.embed_rows(tokens) if x_in is None else torch.from_numpy(x_in.copy())  # (R, H)
        eps = c.rms_norm_eps

        def post(y: torch.Tensor, w: np.ndarray) -> torch.Tensor:  # Gemma's norm of a block's output
            return K.rmsnorm(y, w, eps) if w.shape[0] else y
        for i, L in enumerate(self.layers):
            h = K.rmsnorm(x, L.attn_norm, eps)
            qkv = K.linear(h, L.wqkv)  # (R, (Hq + 2 Hkv) D)
            if L.wv is not None:  # v kept apart (another format than q, k)
                qkv = torch.cat([qkv, K.linear(h, L.wv)], 1)
            t = int(self.rope_of[i])
            table, kc, vc = cache.layer(i)  # (a sliding-window layer's: the local pool's)
            q = K.qkv_rope_cache(qkv, Hq, Hkv, D, L.q_norm, L.k_norm, eps, self.cos[t], self.sin[t],
                                 table, slot, pos, kc, vc)  # (R, Hq, D); k, v now cached
            a = K.attention(q, kc, vc, table, slot, pos, self.scale, int(self.windows[i]))  # (R, Hq, D)
            x = x + post(K.linear(a.reshape(R, Hq * D), L.wo), L.post_attn_norm)
            h = K.rmsnorm(x, L.mlp_norm, eps)
            x = x + post(self._experts_ref(h, L) if L.experts else self._mlp_ref(h, L.w_gate, L.w_up, L.w_down),
                         L.post_mlp_norm)
        if hidden is not None:
            hidden[:] = K.rmsnorm(x, self.norm, c.rms_norm_eps).numpy()
        if out_rows is not None:
            x = x[out_rows]
        return K.linear(K.rmsnorm(x, self.norm, c.rms_norm_eps), self.lm_head)


    def _mlp_ref(self, h: torch.Tensor, gate: K.PackedWeight, up: K.PackedWeight, down: K.PackedWeight) -> torch.Tensor:
        gu = torch.cat([K.linear(h, gate), K.linear(h, up)], 1)  # (R, 2I)
        return K.linear(K.gated_mul(gu, self.gated), down)

    def _experts_ref(self, h: torch.Tensor, L: Layer) -> torch.Tensor:
        """A mixture of experts: each row's top k experts (kernels.moe.route_ref), each expert run on the
        rows that chose it, their outputs times the weights added to zero in expert-index order."""
        idx, w = K.route_ref(K.linear(h, L.w_router), self.cfg.n_experts_used, self.cfg.norm_topk)
        y = torch.zeros_like(h)
        for e, (gate, up, down) in enumerate(L.experts):
            rows, j = (idx == e).nonzero(as_tuple=True)  # rows in order, each at most once
            if rows.numel():
                y[rows] = y[rows] + self._mlp_ref(h[rows], gate, up, down) * w[rows, j][:, None]
        return y
