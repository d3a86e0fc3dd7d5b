"""GGUF files (llama.cpp's format): the header read and checked by `gguf_header.read_header` (the tensors
as views of a read-only memory map, laid out as ggml-org's `gguf` package lays them out), the config from the
metadata, tensors served by their Hugging Face names (the `TensorStore` interface), dequantized by
`gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, ...), with llama.cpp's
q/k row permutation undone for the llama architecture (its converter interleaves the rotary
halves; our rope, like transformers', rotates halves). Tensors in the block formats the kernel keeps
quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K) are also served as they are stored (`get_quant`, see kernels/quant.py).

The tokenizer comes from the `tokenizer.ggml.*` metadata (`gguf_tokenizer.py`), the chat
template from `tokenizer.chat_template`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..kernels import quant as Q
from .config import ModelConfig, check_numbers
from .gguf_header import Header, read_header
from ..errors import CheckpointError, UnsupportedModelError, WeightError
from ..text.tokenizer import Tokenizer
from .weights import finite

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe")
_REQUIRED = object()  # _field's default: a missing field is an error

_LAYER = {  # HF name inside model.layers.{i}. -> GGUF name inside blk.{i}.
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # a mixture of experts' router
}
# a mixture of experts: expert e's weight is slice e of one (E, N, K) tensor per layer and kind
_EXPERTS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}
_GEMMA3 = {**_LAYER, "post_attention_layernorm.weight": "post_attention_norm.weight",
           "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(hf: str, arch: str = "llama") -> str | None:
    return locate(hf, arch)[0]


def locate(hf: str, arch: str = "llama") -> tuple[str | None, int | None]:
    """The GGUF tensor holding the HF tensor `hf`, and the expert's index in it (None: the whole tensor)."""
    if hf in _TOP:
        return _TOP[hf], None
    layer = _GEMMA3 if arch == "gemma3" else _LAYER
    parts = hf.split(".", 3)  # model, layers, i, rest
    if len(parts) != 4 or parts[:2] != ["model", "layers"]:
        return None, None
    if parts[3] in layer:
        return f"blk.{parts[2]}.{layer[parts[3]]}", None
    sub = parts[3].split(".")  # mlp, experts, e, gate_proj, weight
    if len(sub) == 5 and sub[:2] == ["mlp", "experts"] and sub[2].isdigit() and sub[3] in _EXPERTS and sub[4] == "weight":
        return f"blk.{parts[2]}.{_EXPERTS[sub[3]]}", int(sub[2])
    return None, None


def _reader(path: Path) -> Header:
    try:
        return read_header(path)  # every count checked against the file's size as it is read
    except OSError as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None


class GGUFFile:
    """One .gguf file: its config (`cfg`) and the `TensorStore` interface (`has`, `get`)."""

    def __init__(self, path: Path):
        self.path = path
        self.header = _reader(path)
        self.tensors = {t.name: t for t in self.header.tensors}
        self.arch = self._field("general.architecture")
        if self.arch not in ARCHS:
            raise UnsupportedModelError(f"{path}: GGUF architecture {self.arch!r} is not supported "
                                        f"(supported: {', '.join(ARCHS)})")
        self.cfg = self._config()

    def _field(self, key: str, default=_REQUIRED):
        f = self.header.fields.get(key, _REQUIRED)
        if f is _REQUIRED:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.path}: metadata field {key!r} is missing")
            return default
        try:
            return _text(f)
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: metadata field {key!r} is not valid UTF-8 text ({e.reason} at byte "
                                  f"{e.start})") from None

    def _count(self, key: str, default=_REQUIRED) -> int:
        """A size or count from the metadata: an integer >= 1 (0 heads divided by zero, deep inside)."""
        v = self._field(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise CheckpointError(f"{self.path}: metadata field {key!r} is {v!r}, expected an integer >= 1")
        return int(v)

    def _config(self) -> ModelConfig:
        a = self.arch
        g = lambda k: self._field(f"{a}.{k}")  # noqa: E731
        scaling_type = self._field(f"{a}.rope.scaling.type", "none")
        if scaling_type not in ("none", "") and not (a == "gemma3" and scaling_type == "linear"):  # yarn: not yet
            raise UnsupportedModelError(f"{self.path}: rope scaling {a}.rope.scaling.type="
                                        f"{self._field(f'{a}.rope.scaling.type')!r} is not supported (Llama 3.x's "
                                        "rope_freqs tensor is)")
        n_heads = self._count(f"{a}.attention.head_count")
        hidden = self._count(f"{a}.embedding_length")
        n_layers = self._count(f"{a}.block_count")
        if f"blk.{n_layers - 1}.attn_norm.weight" not in self.tensors or f"blk.{n_layers}.attn_norm.weight" in self.tensors:
            have = sum(1 for n in self.tensors if n.endswith(".attn_norm.weight") and n.startswith("blk."))
            raise CheckpointError(f"{self.path}: metadata field '{a}.block_count' is {n_layers}, the file has "
                                  f"tensors of {have} layers")
        tokens = self._field("tokenizer.ggml.tokens", None)
        vocab = int(self._field(f"{a}.vocab_size", None) or (len(tokens) if tokens else 0))
        if not vocab:
            vocab = int(self.tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in self.tensors else 0
        eos = self._field("tokenizer.ggml.eos_token_id", None)
        keys = {"n_heads": f"{a}.attention.head_count", "n_kv_heads": f"{a}.attention.head_count_kv",
                "head_dim": f"{a}.attention.key_length", "rms_norm_eps": f"{a}.attention.layer_norm_rms_epsilon",
                "rope_theta": f"{a}.rope.freq_base"}
        cfg = ModelConfig(
            arch=a, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=self._count(f"{a}.feed_forward_length", 1 if a == "qwen3moe" else _REQUIRED),
            n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=self._count(f"{a}.attention.head_count_kv", n_heads),
            head_dim=self._count(f"{a}.attention.key_length", hidden // n_heads),
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=self._count(f"{a}.context_length"),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)), rope_scaling=self._rope_freqs(),
            tie_word_embeddings="output.weight" not in self.tensors,
            qkv_bias="blk.0.attn_q.bias" in self.tensors, o_bias="blk.0.attn_output.bias" in self.tensors,
            mlp_bias="blk.0.ffn_up.bias" in self.tensors, qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            sliding_window=None, eos_token_ids=self._eos_ids(eos, tokens),
            bos_token_id=self._field("tokenizer.ggml.bos_token_id", None))
        if a == "qwen3moe":
            cfg = self._qwen3moe(cfg)
            keys = {**keys, "n_experts_used": f"{a}.expert_used_count", "n_experts": f"{a}.expert_count"}
        if a == "gemma3":
            cfg = self._gemma3(cfg, scaling_type)
            keys = {**keys, "layer_windows": f"{a}.attention.sliding_window_pattern",
                    "rope_local_theta": f"{a}.rope.freq_base_swa"}
        return check_numbers(cfg, str(self.path), keys)

    def _gemma3(self, cfg: ModelConfig, scaling_type: str) -> ModelConfig:
        """Gemma 3 as llama.cpp reads it: norms stored as (1 + w) by its converter, the embedding scaled by
        sqrt(hidden) (float32), windowed layers (sliding_window, every layer but each sliding_window_pattern-th,
        default 6, or a per-layer list) on their own RoPE base (freq_base_swa, default 10000, never scaled),
        scores scaled by 1/sqrt(head size) (1/sqrt(hidden / heads) for the 62-layer 27B, as llama.cpp does)."""
        import dataclasses
        a, n = self.arch, cfg.n_layers
        window = self._field(f"{a}.attention.sliding_window", 0)
        pattern = self._field(f"{a}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            if len(pattern) != n:
                raise CheckpointError(f"{self.path}: metadata field '{a}.attention.sliding_window_pattern' lists "
                                      f"{len(pattern)} layers, the model has {n}")
            windowed = [bool(x) for x in pattern]
        elif isinstance(pattern, (int, np.integer)) and not isinstance(pattern, bool) and pattern >= 0:
            windowed = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]
        else:
            raise CheckpointError(f"{self.path}: metadata field '{a}.attention.sliding_window_pattern' is "
                                  f"{pattern!r}, expected an integer >= 0 or a list of booleans")
        if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 0:
            raise CheckpointError(f"{self.path}: metadata field '{a}.attention.sliding_window' is {window!r}, "
                                  "expected an integer >= 0")
        if self._field(f"{a}.final_logit_softcapping", None):
            raise UnsupportedModelError(f"{self.path}: {a}.final_logit_softcapping is not supported (Gemma 3 has none)")
        scale_dim = cfg.hidden_size // cfg.n_heads if n == 62 else cfg.head_dim
        scaling = cfg.rope_scaling
        if scaling_type == "linear":
            scaling = {"linear": float(self._field(f"{a}.rope.scaling.factor", 1.0))}
        return dataclasses.replace(
            cfg, act="gelu_tanh", embed_scale=float(np.sqrt(np.float32(cfg.hidden_size))), post_norms=True,
            query_scale=1.0 / float(np.sqrt(scale_dim)), rope_scaling=scaling,
            layer_windows=tuple(int(window) if w and window else 0 for w in windowed),
            rope_local_theta=float(self._field(f"{a}.rope.freq_base_swa", 10000.0)))

    def _qwen3moe(self, cfg: ModelConfig) -> ModelConfig:
        """Qwen3-MoE as llama.cpp reads it: expert_count experts of expert_feed_forward_length, expert_used_count
        per token, their weights divided by their sum (llama.cpp's qwen3moe graph does; expert_weights_norm
        where a file says otherwise)."""
        import dataclasses
        a = self.arch
        used = self._field(f"{a}.expert_used_count")
        if isinstance(used, bool) or not isinstance(used, (int, np.integer)):
            raise CheckpointError(f"{self.path}: metadata field '{a}.expert_used_count' is {used!r}, expected an integer")
        return dataclasses.replace(cfg, n_experts=self._count(f"{a}.expert_count"), n_experts_used=int(used),
                                   intermediate_size=self._count(f"{a}.expert_feed_forward_length"),
                                   norm_topk=bool(self._field(f"{a}.expert_weights_norm", True)))

    def _eos_ids(self, eos, tokens) -> tuple[int, ...]:
        """The file's EOS, and for Gemma the end of a chat turn (<end_of_turn>, as its generation config and
        llama.cpp's end-of-generation tokens have it)."""
        ids = () if eos is None else (int(eos),)
        if self.arch == "gemma3" and tokens and "<end_of_turn>" in tokens:
            turn = tokens.index("<end_of_turn>")
            ids += () if turn in ids else (turn,)
        return ids

    def _rope_freqs(self) -> dict | None:
        """Llama 3.x's frequency divisors, as llama.cpp's converter stores them (rope_freqs.weight, F32)."""
        t = self.tensors.get("rope_freqs.weight")
        if t is None:
            return None
        if t.tensor_type.name != "F32" or len(t.shape) != 1:
            raise CheckpointError(f"{self.path}: tensor 'rope_freqs.weight' is {t.tensor_type.name} of shape "
                                  f"{tuple(int(x) for x in t.shape)}; expected a float32 vector (head size / 2)")
        return {"freq_factors": tuple(float(x) for x in np.asarray(t.data, np.float32).reshape(-1))}

    def tokenizer(self) -> Tokenizer | None:
        """The file's tokenizer, or None when its metadata has none (prompts are then token ids)."""
        if "tokenizer.ggml.tokens" not in self.header.fields:
            return None
        return Tokenizer.from_gguf(self._field, self.path)

    # -- the TensorStore interface --------------------------------------------------------------
    def has(self, name: str) -> bool:
        g = gguf_name(name, self.arch)
        return g is not None and g in self.tensors

    def _tensor(self, name: str, shape: tuple[int, ...]):
        """The GGUF tensor `name` is (or is slice `e` of: an expert's), its shape checked: (g, t, data)."""
        g, e = locate(name, self.arch)
        t = self.tensors.get(g) if g else None
        if t is None:
            raise WeightError(f"{self.path}: tensor {g or name!r} ({name}) is missing from the GGUF file")
        logical = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest dimension first
        want = tuple(shape) if e is None else (self.cfg.n_experts,) + tuple(shape)
        if logical != want:
            raise WeightError(f"{self.path}: tensor {g!r} has shape {logical}, the metadata implies {want}")
        return g, t, (t.data if e is None else t.data[e])

    def get_quant(self, name: str, shape: tuple[int, int]) -> Q.Quantized | None:
        """A tensor in a block format the kernel keeps (quant.FORMATS) as it is stored, rows in our
        order (llama q/k unpermuted); None if the tensor is of another type."""
        g, t, data = self._tensor(name, shape)
        fmt = _kept_format(t)
        if fmt is None:
            return None
        w = Q.from_blocks(np.asarray(data), fmt, *shape)
        for scales in (w.d, w.m):  # a block's float16 scale (and minimum): an Inf or NaN there spoils its row
            if scales is not None:
                finite(scales, str(self.path), g)
        if self.arch == "llama" and g.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.cfg.n_heads if g.endswith("attn_q.weight") else self.cfg.n_kv_heads
            w = w.rows(lambda a: _unpermute(a, heads))
        return w

    def quant_formats(self) -> dict[str, str]:
        """{HF name: format} of the tensors stored in a format of quant.FORMATS."""
        per_layer = list(_LAYER) + [f"mlp.experts.{e}.{k}.weight" for e in range(self.cfg.n_experts) for k in _EXPERTS]
        names = list(_TOP) + [f"model.layers.{i}.{k}" for i in range(self.cfg.n_layers) for k in per_layer]
        fmts = {n: _kept_format(self.tensors[g]) for n in names if (g := gguf_name(n, self.arch)) in self.tensors}
        return {n: f for n, f in fmts.items() if f is not None}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import gguf
        g, t, data = self._tensor(name, shape)
        try:
            w = gguf.quants.dequantize(data, t.tensor_type)
        except NotImplementedError:
            raise WeightError(f"{self.path}: tensor {g!r} has type {t.tensor_type.name}, which the gguf package "
                              "cannot dequantize") from None
        w = finite(torch.from_numpy(np.array(w, dtype=np.float32).reshape(shape)), str(self.path), g)  # a copy
        if self.arch == "llama" and g.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute(w, self.cfg.n_heads if g.endswith("attn_q.weight") else self.cfg.n_kv_heads)
        return w.to(dtype)


def _text(v):
    """A metadata value with its strings decoded as UTF-8 (lists element by element)."""
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if isinstance(v, list) and v and isinstance(v[0], (bytes, list)):
        return [_text(x) for x in v]
    return v


def _kept_format(t) -> str | None:
    """The quant.FORMATS name of a GGUF tensor's type, or None for a type the kernel does not keep."""
    fmt = t.tensor_type.name.lower()
    return fmt if fmt in Q.FORMATS else None


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter: per head, rows (pairs of rotary halves interleaved) back to halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
