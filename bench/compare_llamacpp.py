"""exactspec vs llama.cpp on the same weights (BF16, or Q8_0 / Q4_0 / Q4_1 / Q4_K_M / Q5_K_M kept
quantized by both), side by side in one run, 2 threads each.

    python bench/compare_llamacpp.py --llama-bench PATH [--tokens 64] [--repeat 3] [--gguf FILE] \
        [--qtype BF16 Q8_0 Q4_0 Q4_1 FILE] [--activations int8 float32] [--shape 0.5b|7b|llama3-1b|qwen3moe]

The AVX2 level on any x86 machine: ours with NUMBA_CPU_NAME=haswell (the header line names the path it ran),
llama-bench built with -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF.

The peer is llama.cpp's own `llama-bench` binary (--llama-bench; build it from the llama-cpp-python
sdist's vendor/llama.cpp, see bench/README or the closing notes: `pip download llama-cpp-python==0.3.36
--no-deps --no-binary :all:`, untar, `cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
-DCMAKE_BUILD_TYPE=Release && cmake --build build -j2 --target llama-bench`), run as `llama-bench -m FILE
-t THREADS -p 64 -n TOKENS -r 1 -o json`; without it, llama-cpp-python's bindings (--llama-python).

A random Llama in Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14/2 heads, intermediate 4864,
vocabulary 32000, tied embeddings) is saved once as a HF folder (for exactspec) and written as a
BF16 GGUF with gguf.GGUFWriter (for llama.cpp: q/k rows permuted to its rotary layout, as its own
converter does), and as a GGUF of each quantized --qtype (every matrix, embedding included, quantized
by the gguf package, as llama.cpp's quantize does for a "pure" file). With --gguf FILE, FILE's
weights dequantized to BF16 (or quantized from there), and FILE itself as it is (--qtype FILE).
Q4_K_M, Q5_K_M: llama.cpp's own mixes of formats per layer, made from the BF16 file by its
`llama-quantize` binary (--llama-quantize; built with the target llama-quantize as llama-bench is).
--shape 7b: a Llama-2-7B-shape Q4_0 file (32 layers, hidden 4096, intermediate 11008, vocabulary
32000) written directly as random valid blocks (no float weights), both sides reading it.
--shape qwen3moe: a mixture of experts in Qwen3-30B-A3B's shape scaled to these machines (12 layers,
hidden 2048, 32/4 heads of 128, 64 experts of 768, 8 per token, vocabulary 32000), written directly as
random valid blocks in llama.cpp's Q4_K_M mix (Q4_K, Q6_K for attn_v and ffn_down_exps in its
more-bits layers and the head, the router in F32).
Each side runs in its own process, one after the other (their thread pools spin after each call and
would steal each other's cores): prompt processing of a 64-token prompt (tokens/s) and greedy
generation (tokens/s), median of --repeat runs; for ours also the verify cost forward(k)/forward(1)
on a 64-token cache, for each --activations choice of quantized weights.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import QWEN_05B, table, timed

SHAPE = dict(QWEN_05B, rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2)
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# Llama-3.2-1B's shape, with its RoPE scaling (llama3: written as the rope_freqs tensor, as llama.cpp's
# converter writes it)
LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192))
# Qwen3-30B-A3B (48 layers, 128 experts) scaled to 2 cores and ~2 GB: its hidden size, heads, expert size and
# experts per token; a quarter of its layers, half its experts, a placeholder vocabulary
QWEN3_MOE = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=12, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
                 moe_intermediate_size=768, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0)
PROMPT = [1] + list(range(300, 363))  # 64 tokens
MIXES = ("Q4_K_M", "Q5_K_M")  # llama.cpp's per-layer mixes (llama-quantize)


def build(folder: Path, qtypes: list[str], shape: dict = SHAPE) -> None:
    import torch
    import transformers as tf
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**shape)).to(torch.bfloat16).eval()
    if "BF16" in qtypes:
        model.save_pretrained(folder / "hf")
    sd = model.state_dict()
    del model
    for q in _written(qtypes):
        write_gguf(sd, folder / f"model-{q.lower()}.gguf", shape, q)


def from_gguf(src: Path, folder: Path, qtypes: list[str]) -> dict:
    """Dequantize a llama GGUF (e.g. SmolLM2's Q4_1) to BF16 and write it as model-bf16.gguf: both
    sides then read the very same BF16 weights from one file."""
    import torch
    from exactspec.model.gguf_file import GGUFFile, gguf_name
    store = GGUFFile(src)
    c = store.cfg
    if _written(qtypes) == ["FILE"]:  # the file as it is (any architecture we load, e.g. Gemma 3's Q4_K_M)
        (folder / "model-file.gguf").symlink_to(src.resolve())
        return dict(hidden_size=c.hidden_size, num_hidden_layers=c.n_layers)
    if c.arch != "llama":
        raise SystemExit(f"{src}: only llama GGUF files are converted here (got {c.arch})")
    shape = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                 num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                 max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                 rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings)
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}" for i in range(c.n_layers) for n in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight")]
    sd = {}
    for n in names:
        t = store.tensors[gguf_name(n)]
        sd[n] = store.get(n, tuple(int(d) for d in reversed(t.shape.tolist())), torch.bfloat16)
    for q in qtypes:
        if q == "FILE":
            (folder / "model-file.gguf").symlink_to(src.resolve())
        else:
            write_gguf(sd, folder / f"model-{q.lower()}.gguf", shape, q)
    return shape


def random_q4_0(folder: Path) -> None:
    """model-q4_0.gguf in LLAMA2_7B's shape, every matrix random valid Q4_0 blocks (float16 scales of
    +-(0.002..0.02), random nibbles), norms 1: written block by block, no float weights."""
    import gguf
    import numpy as np
    c = LLAMA2_7B
    rng = np.random.default_rng(0)
    w = _writer(folder / "model-q4_0.gguf", c, "Q4_0")
    H, I = c["hidden_size"], c["intermediate_size"]

    def blocks(n: int, k: int) -> np.ndarray:
        b = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
        d = (rng.uniform(0.002, 0.02, (n, k // 32)) * rng.choice([-1, 1], (n, k // 32))).astype(np.float16)
        b[:, :, :2] = d.view(np.uint8).reshape(n, k // 32, 2)
        return b.reshape(n, -1)

    def put(name: str, n: int, k: int) -> None:
        w.add_tensor(name, blocks(n, k), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    put("token_embd.weight", c["vocab_size"], H)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    put("output.weight", c["vocab_size"], H)
    for i in range(c["num_hidden_layers"]):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(H, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            put(b + name + ".weight", H, H)
        put(b + "ffn_gate.weight", I, H)
        put(b + "ffn_up.weight", I, H)
        put(b + "ffn_down.weight", H, I)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_moe(folder: Path) -> None:
    """model-q4_k_m.gguf in QWEN3_MOE's shape: random valid Q4_K / Q6_K blocks (tools.testing's), as llama.cpp's
    Q4_K_M mix lays them out (Q6_K: attn_v and ffn_down_exps in its more-bits layers, and the head), the
    router random F32, norms 1."""
    import gguf
    import numpy as np
    from exactspec.tools.testing import q4_k_blocks, q6_k_blocks
    c = QWEN3_MOE
    T = gguf.GGMLQuantizationType
    w = _writer(folder / "model-q4_k_m.gguf", c, "Q4_K_M", arch="qwen3moe")
    H, E, I, D, L = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"], c["head_dim"], c["num_hidden_layers"]
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_expert_count(E)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(I)
    seed = iter(range(10**6))

    def put(name: str, shape: tuple, q6: bool = False) -> None:
        n, k = int(np.prod(shape[:-1])), shape[-1]
        b = (q6_k_blocks if q6 else q4_k_blocks)(n, k, seed=next(seed))
        w.add_tensor(name, b.reshape(shape[:-1] + (-1,)), raw_dtype=T.Q6_K if q6 else T.Q4_K)

    def more_bits(i: int) -> bool:  # llama.cpp's use_more_bits: the first and last eighth, every third between
        return i < L // 8 or i >= 7 * L // 8 or (i - L // 8) % 3 == 2
    rng = np.random.default_rng(0)
    put("token_embd.weight", (c["vocab_size"], H))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    put("output.weight", (c["vocab_size"], H), q6=True)
    for i in range(L):
        b = f"blk.{i}."
        for name, n in (("attn_norm", H), ("ffn_norm", H), ("attn_q_norm", D), ("attn_k_norm", D)):
            w.add_tensor(b + name + ".weight", np.ones(n, np.float32))
        put(b + "attn_q.weight", (c["num_attention_heads"] * D, H))
        put(b + "attn_k.weight", (c["num_key_value_heads"] * D, H))
        put(b + "attn_v.weight", (c["num_key_value_heads"] * D, H), q6=more_bits(i))
        put(b + "attn_output.weight", (H, c["num_attention_heads"] * D))
        w.add_tensor(b + "ffn_gate_inp.weight", rng.standard_normal((E, H), np.float32) * np.float32(0.05))
        put(b + "ffn_gate_exps.weight", (E, I, H))
        put(b + "ffn_up_exps.weight", (E, I, H))
        put(b + "ffn_down_exps.weight", (E, H, I), q6=more_bits(i))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _writer(path: Path, c: dict, qtype: str, arch: str = "llama"):
    """A GGUFWriter with the metadata of shape c and a placeholder vocabulary."""
    import gguf
    H, Hq, Hkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c.get("intermediate_size", c.get("moe_intermediate_size")))
    w.add_head_count(Hq)
    w.add_head_count_kv(Hkv)
    w.add_rope_dimension_count(c.get("head_dim", H // Hq))
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_file_type(getattr(gguf.LlamaFileType, "MOSTLY_" + qtype))
    # a SentencePiece-style vocabulary of placeholder pieces: the benchmark feeds token ids only
    V = c["vocab_size"]
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    toks += [f"\u2581t{i}" for i in range(V - len(toks))]
    types += [gguf.TokenType.NORMAL] * (V - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * V)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    return w


def write_gguf(sd: dict, path: Path, c: dict, qtype: str = "BF16") -> None:
    """BF16: every matrix as bfloat16. Q8_0, Q4_0, Q4_1: every matrix quantized by the gguf package (as
    llama.cpp's quantize does for a pure file of that type, the embedding and the head included)."""
    import gguf
    import numpy as np
    import torch
    Hq, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    w = _writer(path, c, qtype)

    def permute(t: torch.Tensor, heads: int) -> torch.Tensor:  # HF rotate-half rows -> llama.cpp's pairs
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    def put(name: str, t: torch.Tensor) -> None:
        if t.dim() == 1:
            w.add_tensor(name, t.float().numpy())
        elif qtype != "BF16":
            qt = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(name, gguf.quants.quantize(t.float().contiguous().numpy(), qt), raw_dtype=qt)
        else:
            bits = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)

    if (c.get("rope_scaling") or {}).get("rope_type") == "llama3":  # the converter's rope_freqs tensor
        from exactspec.model.transformer import llama3_factors, rope_frequencies
        f = rope_frequencies(c["rope_theta"], c["hidden_size"] // Hq)
        w.add_tensor("rope_freqs.weight", llama3_factors(f, c["rope_scaling"]))
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    for i in range(c["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(b + "attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], Hq))
        put(b + "attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], Hkv))
        put(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _written(qtypes: list[str]) -> list[str]:
    """The files written here for `qtypes` (the mixes are quantized from the BF16 one by llama-quantize)."""
    return list(dict.fromkeys([q for q in qtypes if q not in MIXES] + (["BF16"] if set(qtypes) & set(MIXES) else [])))


def run_ours(folder: Path, tokens: int, threads: int, qtype: str, activations: str = "int8") -> dict:
    import exactspec
    from exactspec.model.transformer import Rows
    exactspec.set_num_threads(threads)
    if qtype != "BF16":  # the very file llama.cpp reads, its quantized weights kept quantized
        model = exactspec.load(folder / f"model-{qtype.lower()}.gguf", max_context=512, activations=activations)
    else:
        src = folder / "hf" if (folder / "hf").is_dir() else folder / "model-bf16.gguf"
        model = exactspec.load(src, dtype="bfloat16", max_context=512)
    model.generate(PROMPT, 4, ignore_eos=True)  # compile, warm
    r = model.generate(PROMPT, tokens, ignore_eos=True)
    gen = (len(r.token_ids) - 1) / (r.stats.wall_time - r.stats.time_to_first_token)
    net, cache = model.net, model.net.new_cache(1, 128)
    rows = Rows()
    rows.add(0, PROMPT, 0)
    rows.forward(net, cache)
    times = {}
    for m in (1, 5, 9):  # verify cost: m rows after a 64-token prompt
        rows = Rows()
        rows.add(0, PROMPT[:m], len(PROMPT), logits_from=0)
        times[m] = statistics.median(timed(lambda: rows.forward(net, cache)) for _ in range(7))
    return {"pp": len(PROMPT) / r.stats.time_to_first_token, "tg": gen, "tokens": r.token_ids,
            "v5": times[5] / times[1], "v9": times[9] / times[1]}


def run_llamabench(binary: str, folder: Path, tokens: int, threads: int, qtype: str) -> dict:
    out = subprocess.run([binary, "-m", str(folder / f"model-{qtype.lower()}.gguf"), "-t", str(threads), "-p",
                          str(len(PROMPT)), "-n", str(tokens), "-r", "1", "-o", "json"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"llama-bench failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout)
    pp = next(r["avg_ts"] for r in res if r["n_prompt"] and not r["n_gen"])
    tg = next(r["avg_ts"] for r in res if r["n_gen"] and not r["n_prompt"])
    return {"pp": pp, "tg": tg, "tokens": None}


def run_llamacpp(folder: Path, tokens: int, threads: int, qtype: str) -> dict:
    import numpy as np
    from llama_cpp import Llama

    def argmax() -> int:  # the last row's logits, read from the context (Llama.scores is only kept with logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
    llm = Llama(str(folder / f"model-{qtype.lower()}.gguf"), n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    llm.eval(PROMPT[:8])  # warm
    llm.reset()
    t = time.perf_counter()
    llm.eval(PROMPT)
    pp = len(PROMPT) / (time.perf_counter() - t)
    out = [argmax()]
    t = time.perf_counter()
    for _ in range(tokens - 1):
        llm.eval([out[-1]])
        out.append(argmax())
    return {"pp": pp, "tg": (tokens - 1) / (time.perf_counter() - t), "tokens": out}


def _child(side: str, folder: str, tokens: int, threads: int, python: str, qtype: str, act: str = "") -> dict:
    extra = f", {act!r}" if act else ""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import compare_llamacpp as c; "
            f"from pathlib import Path; print(json.dumps(c.run_{side}(Path({folder!r}), {tokens}, {threads}, "
            f"{qtype!r}{extra})))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{side} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (the peer)")
    ap.add_argument("--llama-python", default=sys.executable, help="without --llama-bench: a Python with "
                    "llama-cpp-python installed")
    ap.add_argument("--gguf", default=None, help="a llama GGUF file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf): "
                    "dequantized to one BF16 GGUF that both sides load, instead of the random 0.5B-shape model")
    ap.add_argument("--qtype", nargs="+", default=["BF16", "Q8_0", "Q4_0"],
                    choices=["BF16", "Q8_0", "Q4_0", "Q4_1", *MIXES, "FILE"],
                    help="weight formats to compare (quantized: kept quantized by both sides; Q4_K_M, Q5_K_M: "
                    "llama.cpp's mixes, made by --llama-quantize from the BF16 file; FILE: the --gguf file as it is)")
    ap.add_argument("--llama-quantize", default=None, help="llama.cpp's llama-quantize binary (for Q4_K_M, Q5_K_M)")
    ap.add_argument("--activations", nargs="+", default=["int8"], choices=["int8", "float32"],
                    help="ours, for quantized weights: int8 (integer dot products) and/or float32")
    ap.add_argument("--shape", default="0.5b", choices=["0.5b", "7b", "llama3-1b", "qwen3moe"],
                    help="7b: a random Llama-2-7B-shape Q4_0 file; llama3-1b: a random Llama-3.2-1B shape with its "
                    "rope_freqs (BF16, then --qtype's formats); qwen3moe: a random Qwen3-30B-A3B-like Q4_K_M file")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.shape == "7b":
            a.qtype = ["Q4_0"]
            random_q4_0(Path(tmp))
            what = "Llama-2-7B shape, random valid Q4_0 blocks"
        elif a.shape == "qwen3moe":
            a.qtype = ["Q4_K_M"]
            random_moe(Path(tmp))
            what = "Qwen3-MoE (30B-A3B-like: 12 layers, 64 experts, 8 per token), random valid Q4_K_M blocks"
        elif a.gguf:
            shape = from_gguf(Path(a.gguf), Path(tmp), _written(a.qtype))
            what = (f"{Path(a.gguf).name}{' as it is' if _written(a.qtype) == ['FILE'] else ' dequantized to BF16'} "
                    f"(hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers)")
        else:
            if "FILE" in a.qtype:
                raise SystemExit("--qtype FILE needs --gguf FILE")
            if a.shape == "llama3-1b":
                build(Path(tmp), a.qtype, LLAMA32_1B)
                what = "Llama-3.2-1B shape with llama3 rope_freqs, random weights"
            else:
                build(Path(tmp), a.qtype)
                what = "Llama, Qwen2.5-0.5B shape, random weights, BF16"
        for q in set(a.qtype) & set(MIXES) if a.shape != "qwen3moe" else ():  # llama.cpp's mix, from the BF16 file
            if not a.llama_quantize:
                raise SystemExit(f"--qtype {q} needs --llama-quantize PATH")
            subprocess.run([a.llama_quantize, str(Path(tmp) / "model-bf16.gguf"), str(Path(tmp) / f"model-{q.lower()}.gguf"),
                            q, str(a.threads)], check=True, capture_output=True)
        ours = [(q, act) for q in a.qtype for act in (a.activations if q != "BF16" else ["float32"])]
        runs = {key: [] for key in ours + [(q, "llamacpp") for q in a.qtype]}
        for _ in range(a.repeat):  # alternate, so slow drifts of the machine hit both sides
            for q in a.qtype:
                for act in (a.activations if q != "BF16" else ["float32"]):
                    runs[(q, act)].append(_child("ours", tmp, a.tokens, a.threads, sys.executable, q, act))
                if a.llama_bench:
                    runs[(q, "llamacpp")].append(run_llamabench(a.llama_bench, Path(tmp), a.tokens, a.threads, q))
                else:
                    runs[(q, "llamacpp")].append(_child("llamacpp", tmp, a.tokens, a.threads, a.llama_python, q))
    med = {key: {k: statistics.median(r[k] for r in rs) for k in ("pp", "tg")} for key, rs in runs.items()}
    peer = "llama-bench" if a.llama_bench else "llama-cpp-python"
    print(f"{what}; {a.threads} threads; 64-token prompt, {a.tokens} greedy tokens; median of {a.repeat}; peer: {peer}")
    from exactspec.kernels import cpu  # the level ours ran at (NUMBA_CPU_NAME=haswell: the AVX2 path on any machine)
    d = cpu.describe()
    print(f"ours: {d['cpu']}, numba target {d['numba_target']}, integer dots {d['integer_dot']}")
    rows = []
    for q, act in ours:
        o, ll = med[(q, act)], med[(q, "llamacpp")]
        ot, lt = runs[(q, act)][0]["tokens"], runs[(q, "llamacpp")][0]["tokens"]
        agree = "-" if lt is None else (
            f"{next((i for i, (x, y) in enumerate(zip(ot, lt)) if x != y), min(len(ot), len(lt)))} of {a.tokens}")
        v5 = statistics.median(r["v5"] for r in runs[(q, act)])
        v9 = statistics.median(r["v9"] for r in runs[(q, act)])
        rows.append((q, act, f"{o['pp']:.1f}", f"{ll['pp']:.1f}", f"{o['pp'] / ll['pp']:.2f}x", f"{o['tg']:.2f}",
                     f"{ll['tg']:.2f}", f"{o['tg'] / ll['tg']:.2f}x", f"{v5:.2f}", f"{v9:.2f}", agree))
    table(("weights", "ours: activations", "ours prompt tok/s", "llama.cpp prompt tok/s", "ratio", "ours greedy tok/s",
           "llama.cpp greedy tok/s", "ratio", "ours fwd(5)/fwd(1)", "fwd(9)/fwd(1)", "greedy tokens identical"), rows)


if __name__ == "__main__":
    main()
