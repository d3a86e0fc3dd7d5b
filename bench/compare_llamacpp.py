"""exactspec vs llama.cpp on the same weights (BF16, or Q8_0 / Q4_0 / Q4_1 kept quantized by both),
side by side in one run, 2 threads each.

    pip install -e '.[bench]'        # llama-cpp-python (built from source by pip) and gguf
    python bench/compare_llamacpp.py [--tokens 64] [--repeat 3] [--llama-python PATH] [--gguf FILE] \
        [--qtype BF16 Q8_0 Q4_0 Q4_1 FILE]

A random Llama in Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14/2 heads, intermediate 4864,
vocabulary 32000, tied embeddings) is saved once as a HF folder (for exactspec) and written as a
BF16 GGUF with gguf.GGUFWriter (for llama.cpp: q/k rows permuted to its rotary layout, as its own
converter does), and as a GGUF of each quantized --qtype (every matrix, embedding included, quantized
by the gguf package, as llama.cpp's quantize does for a "pure" file). With --gguf FILE, FILE's
weights dequantized to BF16 (or quantized from there), and FILE itself as it is (--qtype FILE). Each side runs in its own process, one after the other (their thread pools spin
after each call and would steal each other's cores): prompt processing of a 64-token prompt
(tokens/s) and greedy generation (tokens/s, argmax of the logits, no sampler), median of --repeat
runs. Prints the ratios, and how many greedy tokens the two agree on (llama.cpp rounds the
activations to bf16 for its BF16 dot products; exactspec keeps them float32, so they drift apart
at the first near-tie).
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

from common import QWEN_05B, table

SHAPE = dict(QWEN_05B, rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2)
PROMPT = [1] + list(range(300, 363))  # 64 tokens


def build(folder: Path, qtypes: list[str]) -> None:
    import torch
    import transformers as tf
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE)).to(torch.bfloat16).eval()
    model.save_pretrained(folder / "hf")
    for q in qtypes:
        write_gguf(model.state_dict(), folder / f"model-{q.lower()}.gguf", SHAPE, q)


def from_gguf(src: Path, folder: Path, qtypes: list[str]) -> dict:
    """Dequantize a llama GGUF (e.g. SmolLM2's Q4_1) to BF16 and write it as model-bf16.gguf: both
    sides then read the very same BF16 weights from one file."""
    import torch
    from exactspec.model.gguf_file import GGUFFile, gguf_name
    store = GGUFFile(src)
    c = store.cfg
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


def write_gguf(sd: dict, path: Path, c: dict, qtype: str = "BF16") -> None:
    """BF16: every matrix as bfloat16. Q8_0, Q4_0, Q4_1: every matrix quantized by the gguf package (as
    llama.cpp's quantize does for a pure file of that type, the embedding and the head included)."""
    import gguf
    import numpy as np
    import torch
    H, Hq, Hkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(Hq)
    w.add_head_count_kv(Hkv)
    w.add_rope_dimension_count(H // Hq)
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


def run_ours(folder: Path, tokens: int, threads: int, qtype: str) -> dict:
    import exactspec
    exactspec.set_num_threads(threads)
    if qtype != "BF16":  # the very file llama.cpp reads, its quantized weights kept quantized
        model = exactspec.load(folder / f"model-{qtype.lower()}.gguf", max_context=512)
    else:
        src = folder / "hf" if (folder / "hf").is_dir() else folder / "model-bf16.gguf"
        model = exactspec.load(src, dtype="bfloat16", max_context=512)
    model.generate(PROMPT, 4, ignore_eos=True)  # compile, warm
    r = model.generate(PROMPT, tokens, ignore_eos=True)
    gen = (len(r.token_ids) - 1) / (r.stats.wall_time - r.stats.time_to_first_token)
    return {"pp": len(PROMPT) / r.stats.time_to_first_token, "tg": gen, "tokens": r.token_ids}


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


def _child(side: str, folder: str, tokens: int, threads: int, python: str, qtype: str) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import compare_llamacpp as c; "
            f"from pathlib import Path; print(json.dumps(c.run_{side}(Path({folder!r}), {tokens}, {threads}, "
            f"{qtype!r})))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{side} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--llama-python", default=sys.executable, help="a Python with llama-cpp-python installed")
    ap.add_argument("--gguf", default=None, help="a llama GGUF file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf): "
                    "dequantized to one BF16 GGUF that both sides load, instead of the random 0.5B-shape model")
    ap.add_argument("--qtype", nargs="+", default=["BF16", "Q8_0", "Q4_0"],
                    choices=["BF16", "Q8_0", "Q4_0", "Q4_1", "FILE"],
                    help="weight formats to compare (quantized: kept quantized by both sides; FILE: the --gguf file "
                    "as it is)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.gguf:
            shape = from_gguf(Path(a.gguf), Path(tmp), a.qtype)
            what = f"{Path(a.gguf).name} dequantized to BF16 (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers)"
        else:
            if "FILE" in a.qtype:
                raise SystemExit("--qtype FILE needs --gguf FILE")
            build(Path(tmp), a.qtype)
            what = "Llama, Qwen2.5-0.5B shape, random weights, BF16"
        runs = {(q, s): [] for q in a.qtype for s in ("ours", "llamacpp")}
        for _ in range(a.repeat):  # alternate, so slow drifts of the machine hit both sides
            for q in a.qtype:
                runs[(q, "ours")].append(_child("ours", tmp, a.tokens, a.threads, sys.executable, q))
                runs[(q, "llamacpp")].append(_child("llamacpp", tmp, a.tokens, a.threads, a.llama_python, q))
    med = {key: {k: statistics.median(r[k] for r in rs) for k in ("pp", "tg")} for key, rs in runs.items()}
    print(f"{what}; {a.threads} threads; 64-token prompt, {a.tokens} greedy tokens; median of {a.repeat}")
    rows = []
    for q in a.qtype:
        o, ll = med[(q, "ours")], med[(q, "llamacpp")]
        ot, lt = runs[(q, "ours")][0]["tokens"], runs[(q, "llamacpp")][0]["tokens"]
        agree = next((i for i, (x, y) in enumerate(zip(ot, lt)) if x != y), min(len(ot), len(lt)))
        rows.append((q, f"{o['pp']:.1f}", f"{ll['pp']:.1f}", f"{o['pp'] / ll['pp']:.2f}x", f"{o['tg']:.2f}",
                     f"{ll['tg']:.2f}", f"{o['tg'] / ll['tg']:.2f}x", f"{agree} of {a.tokens}"))
    table(("weights", "ours prompt tok/s", "llama.cpp prompt tok/s", "ratio", "ours greedy tok/s",
           "llama.cpp greedy tok/s", "ratio", "greedy tokens identical"), rows)
    for q in a.qtype:
        if q != "BF16" and "BF16" in a.qtype:
            print(f"ours {q} / ours BF16 greedy: {med[(q, 'ours')]['tg'] / med[('BF16', 'ours')]['tg']:.2f}x")


if __name__ == "__main__":
    main()
