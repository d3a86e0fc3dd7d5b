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
from exactspec.model import Rows
from common import QWEN_05B, read_bandwidth, timed


def build(folder: Path, dtype: torch.dtype) -> None:
    import transformers as tf
    cfg = tf.Qwen2Config(**QWEN_05B)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = tf.Qwen2ForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=15, help="timings per forward size (median)")
    a = ap.parse_args()
    K.set_num_threads(a.threads)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    bw = read_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, tdt)
        model = exactspec.load(folder, dtype=a.dtype, max_context=1024)
        prompt = list(range(100, 164))
        model.generate(prompt, 2, ignore_eos=True)
        r = model.generate(prompt, a.tokens, ignore_eos=True)
        ours = (len(r.token_ids) - 1) / (r.stats.wall_time - r.stats.time_to_first_token)

        import transformers as tf
        hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=tdt).eval()
        with torch.no_grad():
            ids = torch.tensor([prompt])
            hf.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)
            t = time.perf_counter()
            g = hf.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)
            hf_tps = (g.shape[1] - ids.shape[1]) / (time.perf_counter() - t)

        # verify cost: forward of 1 vs 5, 8, 9 new rows on top of a 64-token cache
        net = model.net
        cache = net.new_cache(1, 128)
        n = len(prompt)
        rows = Rows()
        rows.add(0, prompt, 0)
        rows.forward(net, cache)
        times = {}
        for m in (1, 5, 8, 9):
            rows = Rows()
            rows.add(0, prompt[:m], n, all_logits=True)
            times[m] = statistics.median(timed(lambda: rows.forward(net, cache)) for _ in range(a.repeat))

        wbytes = sum(p.data.nbytes for L in net.layers for p in (L.wqkv, L.wo, L.w_gate, L.w_up, L.w_down))
        wbytes += net.lm_head.data.nbytes
        kv = 2 * net.cfg.n_layers * net.cfg.n_kv_heads * net.cfg.head_dim * 4 * (n + a.tokens // 2)
        per_token = wbytes + kv
        limit = bw / per_token
    print(f"model: Qwen2.5-0.5B shape, random weights, {a.dtype}; {a.threads} threads")
    print(f"our greedy          {ours:7.2f} tok/s")
    print(f"transformers greedy {hf_tps:7.2f} tok/s   ours/HF = {ours / hf_tps:.2f}x")
    print(f"forward(1 token) {times[1] * 1e3:.1f} ms; verify cost forward(m)/forward(1): "
          + ", ".join(f"m={m}: {times[m] * 1e3:.1f} ms = {times[m] / times[1]:.2f}" for m in (5, 8, 9)))
    print(f"bytes read per token: {per_token / 1e6:.0f} MB (weights {wbytes / 1e6:.0f} MB + KV {kv / 1e6:.1f} MB); "
          f"read bandwidth {bw / 1e9:.1f} GB/s -> limit {limit:.1f} tok/s; ours reaches {ours / limit:.0%}")


if __name__ == "__main__":
    main()
