"""ModelConfig: the frozen facts we need from a HF config.json, per-architecture differences as fields."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError, UnsupportedModelError

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None  # llama3 parameters, or None for plain RoPE
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama with attention_bias
    o_bias: bool  # Llama attention_bias also biases o_proj
    mlp_bias: bool
    qk_norm: bool  # Qwen3
    sliding_window: int | None  # Mistral
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


def _eos(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: config.json not found (is {folder} a Hugging Face checkpoint folder?)")
    try:
        c = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    archs = c.get("architectures") or []
    arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
    if arch is None:
        arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(c.get("model_type", ""))
    if arch is None:
        raise UnsupportedModelError(
            f"{path}: architecture {archs or c.get('model_type')!r} is not supported "
            f"(supported: {', '.join(SUPPORTED)})")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{path}: hidden_act={act!r} is not supported (only 'silu')")

    def need(key: str):
        if key not in c:
            raise CheckpointError(f"{path}: missing field {key!r}")
        return c[key]

    hidden, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    rope = dict(c.get("rope_parameters") or {})  # transformers >= 5 layout
    legacy = c.get("rope_scaling") or {}
    rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    scaling = None
    if rope_type == "llama3":
        src = rope if rope.get("rope_type") == "llama3" else legacy
        try:
            scaling = {k: float(src[k]) for k in
                       ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        except KeyError as e:
            raise CheckpointError(f"{path}: llama3 rope scaling lacks {e.args[0]!r}") from None
    elif rope_type != "default":
        raise UnsupportedModelError(f"{path}: rope type {rope_type!r} is not supported (default, llama3)")
    if arch in ("qwen2", "qwen3") and c.get("use_sliding_window"):
        raise UnsupportedModelError(f"{path}: use_sliding_window=true (per-layer windows) is not supported")
    window = c.get("sliding_window") if arch == "mistral" else None
    return ModelConfig(
        arch=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        n_layers=int(need("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        head_dim=int(c.get("head_dim") or hidden // n_heads),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
        o_bias=arch != "qwen2" and bool(c.get("attention_bias", False)),
        mlp_bias=bool(c.get("mlp_bias", False)),
        qk_norm=arch == "qwen3",
        sliding_window=int(window) if window else None,
        eos_token_ids=_eos(c.get("eos_token_id")),
        bos_token_id=c.get("bos_token_id"),
    )
