"""A checkpoint's tensors into the kernels' layout: which format each kind of linear weight is kept
in, and each layer's weights read, stacked (q/k/v as one qkv weight) and packed. Nothing here
computes; `Transformer.__init__` stacks what `Packer.layer` returns."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from .. import kernels as K
from ..kernels import quant as Q
from ..kernels.layout import LAYOUTS
from .stack import Layer
from .config import ModelConfig
from .weights import TensorStore

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ACTIVATIONS = ("int8", "float32")  # what quantized weights multiply (Packer)
# The stored tensors of each kind of linear weight (one stacked weight per kind and layer). "qk" and
# "v" are the two halves of "qkv" where a file keeps v in another format than q and k in some layer
# (llama.cpp's Q4_K_M: Q6_K v in some layers): then q+k and v are two weights.
KINDS = {"qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "o": ("self_attn.o_proj.weight",), "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
         "down": ("mlp.down_proj.weight",)}
_SPLIT = {"qk": KINDS["qkv"][:2], "v": KINDS["qkv"][2:]}
# the Stack's name of each kind's weight (stack.Layer's field); the router, a mixture of experts', is kept
# in `dtype` (as llama.cpp's quantizer leaves ffn_gate_inp in F32: routing is the MoE's most fragile step)
FIELDS = {"qkv": "wqkv", "v": "wv", "o": "wo", "gate_up": "w_gate", "down": "w_down", "router": "w_router"}


def expert(e: int, name: str) -> str:
    """An expert's tensor inside a layer, as Qwen3-MoE folders name it (name: gate_proj, up_proj, down_proj)."""
    return f"mlp.experts.{e}.{name}.weight"


def kinds(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The stored tensors of each kind in a layer: KINDS, or a mixture of experts' (every expert's gate
    and up; every expert's down; the router)."""
    E = cfg.n_experts
    if not E:
        return KINDS
    return {**KINDS, "gate_up": tuple(expert(e, n) for e in range(E) for n in ("gate_proj", "up_proj")),
            "down": tuple(expert(e, "down_proj") for e in range(E))}
MAX_LAYER_FORMATS = 2  # formats one kind keeps across layers (stack.Stack keeps two stacks per kind; more: `fold`)
EMBED = "model.embed_tokens.weight"


def fold(fmts: tuple[str, ...], most: int) -> tuple[str, ...] | None:
    """Each layer's format with at most `most` formats over the layers: while there are more, the layers
    of one format take the nearest wider format present (quant.WIDER: the same weights, bit for bit),
    the one that adds the fewest bytes; None where no widening leaves `most`."""
    def per_group(f: str) -> float:  # packed bytes per 32 weights
        return LAYOUTS[f].record_bytes / LAYOUTS[f].groups
    while len(set(fmts)) > most:
        moves = []
        for f in sorted(set(fmts)):
            to = next((w for w in Q.widenings(f) if w in fmts), None)  # the nearest wider one present
            if to is not None:
                moves.append((fmts.count(f) * (per_group(to) - per_group(f)), f, to))
        if not moves:
            return None
        _, f, to = min(moves)
        fmts = tuple(to if x == f else x for x in fmts)
    return fmts


class Packer:
    """quant: "none" (every weight as `dtype`), "keep" (linear weights the store holds in a block
    format of quant.FORMATS stay so: GGUF files), or one of quant.QUANTIZERS (every linear weight
    and the embedding quantized to it at load). activations: "int8" packs quantized weights in the
    integer-dot layouts (their rows' activations quantized to int8, kernels/actquant.py), "float32" in
    the layouts whose weights are dequantized into float FMA chains."""

    def __init__(self, cfg: ModelConfig, store: TensorStore, dtype: str, quant: str = "none",
                 activations: str = "int8"):
        self.cfg, self.store, self.dtype, self.quant, self.wd = cfg, store, dtype, quant, DTYPES[dtype]
        self.int_dot = activations == "int8"
        # The formats each kind is kept in. Layer kinds (qkv, o, gate_up, down; v where split): a tuple
        # of each layer's format (a weight per layer and kind, so every tensor of a kind in one layer
        # must share a format; at most MAX_LAYER_FORMATS formats over the layers, after `fold`), or None: `dtype`.
        # embed, head: one format or None.
        self.stored = store.quant_formats() if quant == "keep" and hasattr(store, "quant_formats") else {}
        self.fmt: dict[str, tuple[str, ...] | str | None] = {k: self._layer_formats(n) for k, n in kinds(cfg).items()}
        self.fmt["v"] = self.fmt["router"] = None
        if self.fmt["qkv"] is None:  # v in its own format in some layer: q+k and v apart
            qk, v = self._layer_formats(_SPLIT["qk"]), self._layer_formats(_SPLIT["v"])
            if qk and v:
                self.fmt["qkv"], self.fmt["v"] = qk, v
        self.fmt["embed"] = self._format([EMBED])

    def _format(self, names: Iterable[str]) -> str | None:
        """The one quantized format the tensors `names` share, or None."""
        if self.quant in Q.FORMATS:
            return self.quant
        if not self.stored:
            return None
        fmts = set()
        for n in names:  # stops at the first tensor not stored quantized (a layer count may be a lie)
            fmts.add(self.stored.get(n))
            if None in fmts or len(fmts) > 1:
                return None
        return fmts.pop() if fmts else None

    def _layer_formats(self, names: tuple[str, ...]) -> tuple[str, ...] | None:
        """Each layer's format of the tensors `names` (one per layer), or None where a layer has none.
        More than MAX_LAYER_FORMATS formats over the layers: folded by lossless widenings (`fold`), or
        None where they cannot be."""
        fmts = []
        for i in range(self.cfg.n_layers):
            f = self._format(f"model.layers.{i}.{n}" for n in names)
            if f is None:
                return None
            fmts.append(f)
        return fold(tuple(fmts), MAX_LAYER_FORMATS)

    def layouts(self) -> dict[str, tuple[str, ...] | None]:
        """{Stack field: each layer's packed layout} ("f32", "bf16", or kernels.LAYOUTS' name), None
        for a field the model does not have (wv unless split, w_router without experts); a mixture of
        experts' w_gate and w_down: each (layer, expert)'s (an expert's format is its layer's)."""
        E = self.cfg.n_experts
        plain = ("bf16" if self.dtype == "bfloat16" else "f32",) * self.cfg.n_layers
        out = {}
        for kind, field in FIELDS.items():
            f = self.fmt[kind]
            out[field] = tuple(x + ("i" if self.int_dot else "") for x in f) if f else (
                None if kind == "v" or (kind == "router" and not E) else plain)
            if E and kind in ("gate_up", "down"):
                out[field] = tuple(x for x in out[field] for _ in range(E))
        return out

    def name(self) -> str:
        """e.g. "q4_1+q8_0+float32": the formats kept, then the rest."""
        kept = {x for f in self.fmt.values() if f for x in ((f,) if isinstance(f, str) else f)}
        return "+".join(sorted(kept) + [self.dtype])

    # -- tensors --------------------------------------------------------------------------------
    def norm(self, name: str, n: int) -> np.ndarray:
        w = self.store.get(name, (n,), torch.float32)
        if self.cfg.norm_offset:  # Gemma's (1 + w), in float32 as transformers computes it
            w = w + self.cfg.norm_offset
        return w.contiguous().numpy()

    def bias(self, name: str, n: int, present: bool) -> torch.Tensor | None:
        return self.store.get(name, (n,), torch.float32) if present else None

    def linear(self, kind: str, parts: list[tuple[str, tuple[int, int]]], b: torch.Tensor | None,
               layer: int | None = None) -> K.PackedWeight:
        """The weights `parts` stacked along N and packed: quantized (kept or at load) or `dtype`."""
        st = self.store
        fmt = self.fmt[kind] if layer is None or self.fmt[kind] is None else self.fmt[kind][layer]
        if fmt:  # (a stored format folded into a wider one: widened, the same weights)
            qs = [Q.widen((st.get_quant(n, s) if self.quant == "keep" else None) or
                          Q.quantize(st.get(n, s, torch.float32).numpy(), fmt, n), fmt) for n, s in parts]
            return K.pack_quant(Q.concat(qs), b, self.int_dot)
        return K.pack_weight(torch.cat([st.get(n, s, self.wd) for n, s in parts]), b)

    # -- the model's pieces -----------------------------------------------------------------------
    def embed(self) -> K.PackedWeight | torch.Tensor:
        """The embedding: packed when quantized (rows looked up from the blocks), else (V, H) as is."""
        c = self.cfg
        if self.fmt["embed"]:
            return self.linear("embed", [(EMBED, (c.vocab_size, c.hidden_size))], None)
        return self.store.get(EMBED, (c.vocab_size, c.hidden_size), torch.float32 if self.quant != "none" else self.wd)

    def head(self, embed: K.PackedWeight | torch.Tensor) -> K.PackedWeight:
        c = self.cfg
        if c.tie_word_embeddings or not self.store.has("lm_head.weight"):  # the head is the embedding, one copy
            return embed if isinstance(embed, K.PackedWeight) else K.pack_weight(embed)
        self.fmt["head"] = self._format(["lm_head.weight"])
        return self.linear("head", [("lm_head.weight", (c.vocab_size, c.hidden_size))], None)

    def layer(self, i: int) -> Layer:
        c = self.cfg
        H, D, Hq, Hkv, I = c.hidden_size, c.head_dim, c.n_heads, c.n_kv_heads, c.intermediate_size
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv = [(a + "q_proj.weight", (Hq * D, H)), (a + "k_proj.weight", (Hkv * D, H)),
               (a + "v_proj.weight", (Hkv * D, H))]
        qkv_b = [self.bias(a + n + "_proj.bias", m, c.qkv_bias) for n, m in (("q", Hq * D), ("k", Hkv * D), ("v", Hkv * D))]
        split = 2 if self.fmt["v"] else 3  # q, k (and v) in one weight

        def cat(bs):
            return torch.cat(bs) if c.qkv_bias else None
        empty = np.empty(0, np.float32)
        mlp_b = c.mlp_bias
        gemma = c.post_norms  # Gemma 3: pre and post norms around both blocks
        if c.n_experts:
            experts = [(self.linear("gate_up", [(p + expert(e, "gate_proj"), (I, H))], None, i),
                        self.linear("gate_up", [(p + expert(e, "up_proj"), (I, H))], None, i),
                        self.linear("down", [(p + expert(e, "down_proj"), (H, I))], None, i)) for e in range(c.n_experts)]
            mlp = dict(zip(("w_gate", "w_up", "w_down"), experts[0]), experts=experts,
                       w_router=self.linear("router", [(p + "mlp.gate.weight", (c.n_experts, H))], None, i))
        else:
            mlp = dict(w_gate=self.linear("gate_up", [(p + "mlp.gate_proj.weight", (I, H))],
                                          self.bias(p + "mlp.gate_proj.bias", I, mlp_b), i),
                       w_up=self.linear("gate_up", [(p + "mlp.up_proj.weight", (I, H))],
                                        self.bias(p + "mlp.up_proj.bias", I, mlp_b), i),
                       w_down=self.linear("down", [(p + "mlp.down_proj.weight", (H, I))],
                                          self.bias(p + "mlp.down_proj.bias", H, mlp_b), i))
        return Layer(
            post_attn_norm=self.norm(p + "post_attention_layernorm.weight", H) if gemma else None,
            post_mlp_norm=self.norm(p + "post_feedforward_layernorm.weight", H) if gemma else None,
            attn_norm=self.norm(p + "input_layernorm.weight", H),
            wqkv=self.linear("qkv", qkv[:split], cat(qkv_b[:split]), i),
            wv=self.linear("v", qkv[2:], cat(qkv_b[2:]), i) if self.fmt["v"] else None,
            q_norm=self.norm(a + "q_norm.weight", D) if c.qk_norm else empty,
            k_norm=self.norm(a + "k_norm.weight", D) if c.qk_norm else empty,
            wo=self.linear("o", [(a + "o_proj.weight", (H, Hq * D))], self.bias(a + "o_proj.bias", H, c.o_bias), i),
            mlp_norm=self.norm(p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight"),
                               H), **mlp)
