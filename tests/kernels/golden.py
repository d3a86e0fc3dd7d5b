"""A golden record: logits hashes and greedy tokens of a test model whose weights are made from
integers (PCG64), so the model itself is bit-identical on every machine. Any x86-64 CPU must
reproduce `golden.json` exactly; `test_cross_cpu.py` checks it here for several compile targets
and CI checks it on whatever machine it lands on.

    python tests/golden.py            # print this machine's record as JSON
    python tests/golden.py --kernels  # without the bfloat16 and int8-activation models (test_cross_cpu's targets)
    python tests/golden.py --write    # overwrite golden.json (only after a deliberate numerics change)
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

GOLDEN = Path(__file__).with_name("golden.json")
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=300, hidden_size=64,
              intermediate_size=136, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=1, hidden_act="silu")


def _ints(rng, shape, scale):
    # small integers / a power of two times a float scale: exactly the same float32 values everywhere
    return torch.from_numpy((rng.integers(-64, 65, shape).astype(np.float32) / np.float32(64) * np.float32(scale)))


# Gemma 3 (a window of 8 on layers 0 and 2, their own RoPE base, GeGLU, four norms, a scaled embedding) and a
# mixture of experts (Qwen3-MoE: 6 experts, 2 per token, q/k norms): float32 models share the Llama's
# compiled forward, so they cost each compile target no compile
GEMMA3 = dict(CONFIG, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=3, head_dim=32,
              sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
              rope_theta=1000000.0, rope_local_base_freq=10000.0, tie_word_embeddings=True, hidden_act=None)
QWEN3_MOE = dict(CONFIG, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=32, num_experts=6,
                 num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True)


def build(folder: Path, dtype: torch.dtype, base: dict = CONFIG, **over) -> Path:
    c = {**base, **over}
    H, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    D = c.get("head_dim") or H // c["num_attention_heads"]
    Hq, Hkv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    gemma, moe = c["model_type"] == "gemma3_text", "num_experts" in c
    rng = np.random.default_rng(1234)
    # (Gemma: the tied embedding scaled by sqrt(H) would outweigh the layers and copy the last token)
    t = {"model.embed_tokens.weight": _ints(rng, (V, H), 1 / 64 if gemma else 1.0)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = _ints(rng, (V, H), 0.25)
    t["model.norm.weight"] = 1 + _ints(rng, (H,), 0.1)
    norms = ["input_layernorm", "post_attention_layernorm"] + ["pre_feedforward_layernorm",
                                                               "post_feedforward_layernorm"] * gemma
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in norms:  # (Gemma's weights are w - 1: its model adds 1)
            t[p + n + ".weight"] = _ints(rng, (H,), 0.1) + (0 if gemma else 1)
        for name, shape in (("q_proj", (Hq, H)), ("k_proj", (Hkv, H)), ("v_proj", (Hkv, H)), ("o_proj", (H, Hq))):
            t[p + f"self_attn.{name}.weight"] = _ints(rng, shape, 0.125)
        if gemma or moe:
            for n in ("q_norm", "k_norm"):
                t[p + f"self_attn.{n}.weight"] = _ints(rng, (D,), 0.1) + (0 if gemma else 1)
        mlps = [f"mlp.experts.{e}." for e in range(c["num_experts"])] if moe else ["mlp."]
        size = c["moe_intermediate_size"] if moe else I
        if moe:
            t[p + "mlp.gate.weight"] = _ints(rng, (c["num_experts"], H), 1.0)
        for m in mlps:
            for name, shape in (("gate_proj", (size, H)), ("up_proj", (size, H)), ("down_proj", (H, size))):
                t[p + m + f"{name}.weight"] = _ints(rng, shape, 0.125)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**c, "torch_dtype": str(dtype)[6:]}))
    return folder


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:32]


def record(full: bool = True) -> dict:
    """The record; not `full`: without the bfloat16 and int8-activation models (their kernels are in the
    record as kernels: what another compile target is checked on, each model a forward compile of minutes)."""
    import exactspec
    from exactspec import kernels as K
    out = {}
    rng = np.random.default_rng(99)
    for dt in (torch.float32, torch.bfloat16):
        w = _ints(rng, (77, 50), 0.3).to(dt)
        x = _ints(rng, (13, 50), 1.7) + _ints(rng, (13, 50), 1e-3)  # many distinct exponents: real roundings
        p = K.pack_weight(w)
        rows = [K.linear(x[:m], p) for m in range(1, 14)]  # every tile height, every row count
        out[f"linear_{str(dt)[6:]}"] = _sha(torch.cat(rows))
    prompt = rng.integers(2, CONFIG["vocab_size"], 24).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        for dt in ("float32", "bfloat16") if full else ("float32",):
            model = exactspec.load(build(Path(tmp) / dt, getattr(torch, dt)), dtype=dt)
            out[f"logits_{dt}"] = _sha(model.logits(prompt))
            g = model.generate(prompt, 40, ignore_eos=True)
            s = model.generate(prompt, 40, ignore_eos=True, draft="lookup", num_draft_tokens=3)
            t = model.generate(prompt, 40, ignore_eos=True, temperature=0.9, top_p=0.9, seed=5)
            out[f"greedy_{dt}"] = g.token_ids
            out[f"lookup_equals_greedy_{dt}"] = s.token_ids == g.token_ids
            out[f"sampled_{dt}"] = t.token_ids
        for name, base in (("gemma3", GEMMA3), ("qwen3moe", QWEN3_MOE)):  # past Gemma's window of 8
            model = exactspec.load(build(Path(tmp) / name, torch.float32, base))
            out[f"logits_{name}"] = _sha(model.logits(prompt))
            g = model.generate(prompt, 40, ignore_eos=True)
            out[f"greedy_{name}"] = g.token_ids
            out[f"lookup_equals_greedy_{name}"] = g.token_ids == model.generate(
                prompt, 40, ignore_eos=True, draft="lookup", num_draft_tokens=3).token_ids
        # Q8_0 kept quantized (the int8 widening, the float16 scales in integer ops): its own generator,
        # so the records above stay as they were; K = 64 and I = 160 are whole groups of 32
        rng8 = np.random.default_rng(8)
        from exactspec.kernels import quant
        p = K.pack_quant(quant.quantize(_ints(rng8, (77, 64), 0.3).numpy(), "q8_0"))
        x = _ints(rng8, (13, 64), 1.7) + _ints(rng8, (13, 64), 1e-3)
        out["linear_q8_0"] = _sha(torch.cat([K.linear(x[:m], p) for m in range(1, 14)]))
        if full:  # the model with int8 activations (the default for quantized weights: integer dot products)
            model = exactspec.load(build(Path(tmp) / "q8", torch.float32, intermediate_size=160), quantize="q8_0")
            assert model.net.activations == "int8"
            out["logits_q8_0i"] = _sha(model.logits(prompt))
            g = model.generate(prompt, 40, ignore_eos=True)
            out["greedy_q8_0i"] = g.token_ids
            out["lookup_equals_greedy_q8_0i"] = g.token_ids == model.generate(
                prompt, 40, ignore_eos=True, draft="lookup", num_draft_tokens=3).token_ids
        for fmt in ("q4_0", "q4_1", "q5_0", "q5_1"):  # the nibble unpacking (and high bits), the minimum's rounding
            rng4 = np.random.default_rng(4)
            p = K.pack_quant(quant.quantize((_ints(rng4, (77, 64), 0.3) + 0.7).numpy(), fmt))
            x = _ints(rng4, (13, 64), 1.7) + _ints(rng4, (13, 64), 1e-3)
            out[f"linear_{fmt}"] = _sha(torch.cat([K.linear(x[:m], p) for m in range(1, 14)]))
        from exactspec.tools.testing import q4_k_blocks
        rng4 = np.random.default_rng(4)
        p = K.pack_quant(quant.from_blocks(q4_k_blocks(77, 256, seed=4), "q4_k", 77, 256))
        x = _ints(rng4, (13, 256), 1.7) + _ints(rng4, (13, 256), 1e-3)
        out["linear_q4_k"] = _sha(torch.cat([K.linear(x[:m], p) for m in range(1, 14)]))
        # the integer-dot kernels (int8 activations): each format, every tile height; ties in the
        # activations (x / d exactly k + 1/2) and a zero block on purpose
        rngi = np.random.default_rng(11)
        x = _ints(rngi, (13, 256), 1.7) + _ints(rngi, (13, 256), 1e-3)
        x[:, 32:64] = 0.0
        x[0, :32] = torch.arange(32, dtype=torch.float32) - 15.5
        x[0, 0] = 127.0  # d = 1: the halves are ties
        for fmt in ("q8_0", "q4_0", "q4_1", "q4_k", "q5_0", "q5_1"):
            wq = (quant.from_blocks(q4_k_blocks(77, 256, seed=11), "q4_k", 77, 256) if fmt == "q4_k" else
                  quant.quantize((_ints(rngi, (77, 256), 0.3) + 0.7).numpy(), fmt))
            p = K.pack_quant(wq, int_dot=True)
            out[f"linear_{fmt}i"] = _sha(torch.cat([K.linear(x[:m], p) for m in range(1, 14)]))
        from exactspec.tools.testing import K_QUANT_BLOCKS
        for fmt in ("q6_k", "q5_k"):  # Q6_K: an int8 scale per 16 k's
            wq = quant.from_blocks(K_QUANT_BLOCKS[fmt](77, 256, seed=6), fmt, 77, 256)
            for int_dot in (False, True):  # both paths
                p = K.pack_quant(wq, int_dot=int_dot)
                out[f"linear_{fmt}" + "i" * int_dot] = _sha(torch.cat([K.linear(x[:m], p) for m in range(1, 14)]))
        # (kernel records only: a whole model in each format would cost every target another forward
        # compile, minutes; test_quantized checks Q4 models against their dequantized twins on this CPU)
    return out


if __name__ == "__main__":
    r = record(full="--kernels" not in sys.argv)
    if "--write" in sys.argv:
        GOLDEN.write_text(json.dumps(r, indent=1) + "\n")
    print(json.dumps(r))
