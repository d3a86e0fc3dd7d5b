"""A memory-bound model: random weights in Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4864, vocabulary 32000), built here, saved as a real checkpoint.

    python bench/memory_bound.py [--dtype bfloat16] [--tokens 32]

Prints, in one run: our greedy tokens/s vs transformers' greedy tokens/s; the verify cost
time(forward of 5, 8, 9 tokens) / time(forward of 1 token) on a warm cache; bytes read per token
(weights + KV cache) against the measured read bandwidth, i.e. the fraction of the
memory-bandwidth limit reached.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import exactspec
from exactspec import kernels as K
from exactspec.model.transformer import Rows
from common import QWEN_05B, read_bandwidth, timed


def build(folder: Path, dtype: torch.dtype) -> None:
    import transformers as tf
    cfg = tf.Qwen2Config(**QWEN_05B)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = tf.Qwen2ForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(folder)


def measure(model, prompt: list[int], tokens: int, repeat: int, bw: float) -> dict:
    """Greedy tok/s (prefill excluded), forward(m) times on a 64-token cache, bytes per token."""
    model.generate(prompt, 2, ignore_eos=True)
    r = model.generate(prompt, tokens, ignore_eos=True)
    tps = (len(r.token_ids) - 1) / (r.stats.wall_time - r.stats.time_to_first_token)
    net = model.net
    cache = net.new_cache(1, 128)
    n = len(prompt)
    rows = Rows()
    rows.add(0, prompt, 0)
    rows.forward(net, cache)
    times = {}
    for m in (1, 5, 8, 9):
        rows = Rows()
        rows.add(0, prompt[:m], n, logits_from=0)
        times[m] = statistics.median(timed(lambda: rows.forward(net, cache)) for _ in range(repeat))
    wbytes = sum(p.data.nbytes for L in net.layers for p in (L.wqkv, L.wv, L.wo, L.w_gate, L.w_up, L.w_down) if p)
    wbytes += net.lm_head.data.nbytes
    kv = 2 * net.cfg.n_layers * net.cfg.n_kv_heads * net.cfg.head_dim * 4 * (n + tokens // 2)
    return dict(tps=tps, times=times, wbytes=wbytes, kv=kv, limit=bw / (wbytes + kv), tokens=r.token_ids)


def report(label: str, m: dict, bw: float) -> None:
    t = m["times"]
    print(f"{label}: greedy {m['tps']:.2f} tok/s; forward(1) {t[1] * 1e3:.1f} ms; forward(m)/forward(1): "
          + ", ".join(f"m={k}: {t[k] / t[1]:.2f}" for k in (5, 8, 9)))
    print(f"  bytes per token {(m['wbytes'] + m['kv']) / 1e6:.0f} MB (weights {m['wbytes'] / 1e6:.0f} + KV "
          f"{m['kv'] / 1e6:.1f}); read bandwidth {bw / 1e9:.1f} GB/s -> limit {m['limit']:.1f} tok/s; "
          f"reaches {m['tps'] / m['limit']:.0%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=15, help="timings per forward size (median)")
    ap.add_argument("--quantize", default=None, choices=["q8_0", "q4_0", "q4_1"],
                    help="also time the model quantized at load")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers run")
    a = ap.parse_args()
    K.set_num_threads(a.threads)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    bw = read_bandwidth()
    prompt = list(range(100, 164))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, tdt)
        ours = measure(exactspec.load(folder, dtype=a.dtype, max_context=1024), prompt, a.tokens, a.repeat, bw)
        q8 = None
        if a.quantize:
            q8 = measure(exactspec.load(folder, max_context=1024, quantize=a.quantize), prompt, a.tokens, a.repeat, bw)
        hf_tps = None
        if not a.no_hf:
            import transformers as tf
            hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=tdt).eval()
            with torch.no_grad():
                ids = torch.tensor([prompt])
                hf.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)
                t = time.perf_counter()
                g = hf.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)
                hf_tps = (g.shape[1] - ids.shape[1]) / (time.perf_counter() - t)
    print(f"model: Qwen2.5-0.5B shape, random weights; {a.threads} threads")
    report(f"ours {a.dtype}", ours, bw)
    if q8 is not None:
        report(f"ours {a.quantize}", q8, bw)
        print(f"{a.quantize} / {a.dtype} greedy: {q8['tps'] / ours['tps']:.2f}x")
    if hf_tps is not None:
        print(f"transformers greedy {hf_tps:.2f} tok/s   ours {a.dtype} / HF = {ours['tps'] / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
