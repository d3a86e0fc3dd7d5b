"""ModelConfig: the frozen facts we need from a HF config.json, per-architecture differences as fields."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, UnsupportedModelError
from ..jsonfile import read_json

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
# Gemma 3's text model under its model_type (a Gemma3ForConditionalGeneration folder is not this)
MODEL_TYPES = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3" | "qwen3moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the gated MLP's size; a mixture of experts': each expert's
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    # RoPE scaling: llama3's parameters (a HF folder), {"freq_factors": (D/2 floats)} (a GGUF file's
    # rope_freqs tensor: the divisor of each frequency), {"linear": factor} (every frequency / factor:
    # Gemma 3's global layers), or None for plain RoPE
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama with attention_bias
    o_bias: bool  # Llama attention_bias also biases o_proj
    mlp_bias: bool
    qk_norm: bool  # Qwen3
    sliding_window: int | None  # Mistral
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Gemma 3's differences (the defaults are every other architecture's)
    act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh"
    norm_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma's HF weights store w - 1)
    embed_scale: float = 0.0  # token embeddings multiplied by it (float32), 0: not scaled
    post_norms: bool = False  # RMSNorm on the attention's and the MLP's outputs before each residual add
    query_scale: float | None = None  # attention score scale; None: 1 / sqrt(head_dim)
    layer_windows: tuple[int, ...] | None = None  # each layer's sliding window (0: global); None: sliding_window
    rope_local_theta: float | None = None  # the RoPE base of windowed layers (their own, unscaled); None: rope_theta
    # a mixture of experts in every layer's MLP (Qwen3-MoE): how many, how many each row takes (the top k of
    # the router's softmax, ties to the lower index), and whether their weights are divided by their sum
    n_experts: int = 0
    n_experts_used: int = 0
    norm_topk: bool = False

    def windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: the whole prefix)."""
        return self.layer_windows or (self.sliding_window or 0,) * self.n_layers

    def rope_tables(self) -> tuple[int, ...]:
        """Each layer's RoPE table: 0 (rope_theta, scaled), or 1 (rope_local_theta, windowed layers)."""
        local = self.rope_local_theta is not None
        return tuple(int(local and w > 0) for w in self.windows())


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the target's vocabulary and its context (max_context),
    and what a server allows (stop strings: how many, how long; None = no limit)."""
    vocab_size: int
    max_context: int
    max_stops: int | None = None
    max_stop_chars: int | None = None


_MISSING = object()
# the config's fields as a HF config.json names them (GGUF files name them by their own keys)
HF_KEYS = {"n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
           "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "rope_scaling": "rope_scaling"}


def check_numbers(cfg: ModelConfig, where: str, keys: dict[str, str] = HF_KEYS) -> ModelConfig:
    """CheckpointError naming the file and key for numbers a model cannot have: a NaN or infinite
    epsilon or RoPE base, a negative epsilon, query heads that do not group over the KV heads, an odd
    head size (RoPE rotates halves). Checked at load, never found as garbage output."""
    def bad(field: str, v, need: str) -> CheckpointError:
        return CheckpointError(f"{where}: {keys.get(field, field)} is {v!r}; {need}")
    if not math.isfinite(cfg.rms_norm_eps) or cfg.rms_norm_eps < 0:
        raise bad("rms_norm_eps", cfg.rms_norm_eps, "expected a finite number >= 0")
    if not math.isfinite(cfg.rope_theta) or cfg.rope_theta <= 0:
        raise bad("rope_theta", cfg.rope_theta, "expected a finite number > 0")
    for k, v in (cfg.rope_scaling or {}).items():
        if k == "freq_factors":
            if len(v) != cfg.head_dim // 2 or not all(math.isfinite(x) and x > 0 for x in v):
                raise bad("rope_scaling", f"{len(v)} factors", f"expected {cfg.head_dim // 2} (head size / 2), each a "
                          "finite number > 0")
        elif not math.isfinite(v) or v <= 0:
            raise bad("rope_scaling", cfg.rope_scaling, f"{k} must be a finite number > 0")
    if cfg.n_kv_heads < 1 or cfg.n_heads % cfg.n_kv_heads:
        raise bad("n_kv_heads", cfg.n_kv_heads, f"the {cfg.n_heads} query heads ({keys.get('n_heads', 'n_heads')}) "
                  "must be a whole multiple of it")
    if cfg.rope_local_theta is not None and (not math.isfinite(cfg.rope_local_theta) or cfg.rope_local_theta <= 0):
        raise bad("rope_local_theta", cfg.rope_local_theta, "expected a finite number > 0")
    if cfg.layer_windows is not None and (len(cfg.layer_windows) != cfg.n_layers or min(cfg.layer_windows) < 0):
        raise bad("layer_windows", cfg.layer_windows, f"expected {cfg.n_layers} windows (one per layer), each >= 0")
    if cfg.query_scale is not None and not (math.isfinite(cfg.query_scale) and cfg.query_scale > 0):
        raise bad("query_scale", cfg.query_scale, "expected a finite number > 0")
    if cfg.n_experts and not 1 <= cfg.n_experts_used <= cfg.n_experts:
        raise bad("n_experts_used", cfg.n_experts_used, f"expected 1 .. {keys.get('n_experts', 'n_experts')} "
                  f"({cfg.n_experts}) experts per token")
    if cfg.head_dim < 2 or cfg.head_dim % 2:
        raise bad("head_dim", cfg.head_dim, "expected an even head size >= 2 (RoPE rotates halves)")
    return cfg


def token_ids(value, where: str) -> tuple[int, ...]:
    """eos_token_id as configs write it: null, an id, or a flat list of ids."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        raise CheckpointError(f"{where}: expected a token id or a list of token ids, got {value!r}")
    return tuple(items)


def get_field(c: dict, path: Path, key: str, kind: type, default=_MISSING):
    """c[key] as an int, float or bool (ints are floats too), or CheckpointError naming the field."""
    v = c.get(key, _MISSING)
    if v is _MISSING or (v is None and default is not _MISSING):
        if default is _MISSING:
            raise CheckpointError(f"{path}: missing field {key!r}")
        return default
    ok = {int: lambda x: isinstance(x, int) and not isinstance(x, bool),
          float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
          bool: lambda x: isinstance(x, bool)}[kind](v)
    if not ok:
        raise CheckpointError(f"{path}: field {key!r} must be {'an' if kind is int else 'a'} {kind.__name__}, "
                              f"got {v!r}")
    return kind(v)


def load_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: config.json not found (is {folder} a Hugging Face checkpoint folder?)")
    c = read_json(path)
    archs = c.get("architectures") or []
    if not isinstance(archs, list):
        raise CheckpointError(f"{path}: field 'architectures' must be a list of names, got {archs!r}")
    arch = next((SUPPORTED[a] for a in archs if isinstance(a, str) and a in SUPPORTED), None)
    if arch is None and c.get("model_type") in SUPPORTED.values():
        arch = c["model_type"]
    arch = arch or MODEL_TYPES.get(c.get("model_type"))
    if arch is None:
        raise UnsupportedModelError(
            f"{path}: architecture {archs or c.get('model_type')!r} is not supported "
            f"(supported: {', '.join(SUPPORTED)})")
    act_key = "hidden_activation" if arch == "gemma3" else "hidden_act"
    act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(c.get(act_key) or c.get("hidden_act") or "silu")
    if act is None or (act == "gelu_tanh") != (arch == "gemma3"):
        raise UnsupportedModelError(f"{path}: {act_key}={c.get(act_key)!r} is not supported "
                                    f"({'gelu_pytorch_tanh' if arch == 'gemma3' else 'silu'})")

    def num(key: str, kind: type = int, default=_MISSING, src: dict = c):
        return get_field(src, path, key, kind, default)

    hidden, n_heads = num("hidden_size"), num("num_attention_heads")
    rope, legacy = c.get("rope_parameters") or {}, c.get("rope_scaling") or {}  # transformers >= 5, < 5 layouts
    for key, v in (("rope_parameters", rope), ("rope_scaling", legacy)):
        if not isinstance(v, dict):
            raise CheckpointError(f"{path}: field {key!r} must be an object, got {v!r}")
    gemma = _gemma3(c, path, num) if arch == "gemma3" else {}
    if gemma:
        rope, legacy = gemma.pop("rope"), {}
    rope_theta = num("rope_theta", float, num("rope_theta", float, 10000.0), src=rope)
    rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    scaling = None
    if rope_type == "llama3":
        src = rope if rope.get("rope_type") == "llama3" else legacy
        try:
            scaling = {k: num(k, float, src=src) for k in
                       ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        except CheckpointError as e:
            raise CheckpointError(f"llama3 rope scaling: {e}") from None
    elif rope_type == "linear" and arch == "gemma3":  # Gemma 3 4B and up: its global layers' frequencies / factor
        scaling = {"linear": num("factor", float, src=rope)}
    elif rope_type != "default":
        raise UnsupportedModelError(f"{path}: rope type {rope_type!r} is not supported (default, llama3)")
    moe = _qwen3moe(c, path, num) if arch == "qwen3moe" else {}
    if arch in ("qwen2", "qwen3", "qwen3moe") and c.get("use_sliding_window"):
        raise UnsupportedModelError(f"{path}: use_sliding_window=true (per-layer windows) is not supported")
    window = num("sliding_window", int, None) if arch == "mistral" else None
    sizes = {k: num(k) for k in ("vocab_size", "intermediate_size", "num_hidden_layers")}
    if moe:
        sizes["intermediate_size"] = moe.pop("intermediate_size")
    bad = next((k for k, v in {**sizes, "hidden_size": hidden, "num_attention_heads": n_heads}.items() if v < 1
                and k != "num_hidden_layers"), None)
    if bad:
        raise CheckpointError(f"{path}: field {bad!r} must be >= 1")
    attention_bias = num("attention_bias", bool, False)
    bos = num("bos_token_id", int, None)
    return check_numbers(ModelConfig(
        arch=arch,
        vocab_size=sizes["vocab_size"],
        hidden_size=hidden,
        intermediate_size=sizes["intermediate_size"],
        n_layers=sizes["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=num("num_key_value_heads", int, n_heads),
        head_dim=num("head_dim", int, hidden // n_heads),
        rms_norm_eps=num("rms_norm_eps", float, 1e-6),
        max_position_embeddings=num("max_position_embeddings", int, 2048),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        tie_word_embeddings=num("tie_word_embeddings", bool, arch == "gemma3"),
        qkv_bias=arch == "qwen2" or attention_bias,
        o_bias=arch != "qwen2" and attention_bias,
        mlp_bias=num("mlp_bias", bool, False),
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
        sliding_window=window or None,
        eos_token_ids=token_ids(c.get("eos_token_id"), f"{path}: field 'eos_token_id'"),
        bos_token_id=bos,
        **gemma, **moe,
    ), str(path), {**HF_KEYS, "n_experts_used": "num_experts_per_tok", "n_experts": "num_experts"})


def _qwen3moe(c: dict, path: Path, num) -> dict:
    """Qwen3-MoE's fields: experts in every layer (a dense MLP in some layers, mlp_only_layers or a
    decoder_sparse_step above 1, is refused: no published Qwen3-MoE has one), each of moe_intermediate_size."""
    n = num("num_experts", int, None)
    n = num("num_local_experts", int) if n is None else n  # transformers 5 writes this name
    if n < 1:
        raise CheckpointError(f"{path}: field 'num_experts' is {n}; a mixture of experts needs at least one")
    if num("decoder_sparse_step", int, 1) != 1 or c.get("mlp_only_layers"):
        raise UnsupportedModelError(f"{path}: dense MLP layers among the experts (decoder_sparse_step="
                                    f"{c.get('decoder_sparse_step')!r}, mlp_only_layers={c.get('mlp_only_layers')!r}) "
                                    "are not supported (experts in every layer)")
    size = num("moe_intermediate_size")
    if size < 1:
        raise CheckpointError(f"{path}: field 'moe_intermediate_size' must be >= 1")
    return {"n_experts": n, "n_experts_used": num("num_experts_per_tok"), "intermediate_size": size,
            "norm_topk": num("norm_topk_prob", bool, False)}


def _gemma3(c: dict, path: Path, num) -> dict:
    """Gemma 3's fields of a Gemma3ForCausalLM config (transformers 4.5x and 5 layouts), and "rope": the
    global layers' RoPE parameters."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            raise UnsupportedModelError(f"{path}: {key}={c[key]!r} is not supported (Gemma 3 has none)")
    n = num("num_hidden_layers")
    types = c.get("layer_types")
    if types is None:  # older configs: every sliding_window_pattern-th layer is global
        pattern = num("sliding_window_pattern", int, 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or not set(types) <= {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"{path}: field 'layer_types' must list 'full_attention' or 'sliding_attention' for "
                              f"each of the {n} layers, got {types!r}")
    window = num("sliding_window", int, None) if "sliding_attention" in types else 0
    if window is None or window < 1:
        raise CheckpointError(f"{path}: field 'sliding_window' is {window!r}; layers of type 'sliding_attention' "
                              "need a window >= 1")
    params = c.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one entry per layer type
        glob, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if not isinstance(glob, dict) or not isinstance(local, dict):
            raise CheckpointError(f"{path}: field 'rope_parameters' must hold an object per layer type")
        local_theta = num("rope_theta", float, 10000.0, src=local)
        if (local.get("rope_type") or "default") != "default":
            raise UnsupportedModelError(f"{path}: sliding layers' rope type {local.get('rope_type')!r} is not "
                                        "supported (default)")
    else:  # transformers 4: rope_theta, rope_local_base_freq, rope_scaling for the global layers
        glob = {**(c.get("rope_scaling") or {}), "rope_theta": num("rope_theta", float, 1000000.0)}
        local_theta = num("rope_local_base_freq", float, 10000.0)
    return {"act": "gelu_tanh", "norm_offset": 1.0, "embed_scale": float(math.sqrt(num("hidden_size"))),
            "post_norms": True, "query_scale": num("query_pre_attn_scalar", float, 256.0) ** -0.5,
            "layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types),
            "rope_local_theta": local_theta, "rope": glob}
