"""How fast one linear layer streams its quantized weights from memory, per format and row count.

    python bench/weight_stream.py [--formats q4_k q6_k q4_1 q8_0] [--rows 1 5] [--threads 2]

A (16384, 2048) weight (a Llama-3.2-1B gate/up pair) in each format's integer-dot layout, 40 copies (more
than the L3 cache) called in turn, as a decode forward reads every layer's weights once: prints the
median time per call, the bytes read per second, and that against the machine's read bandwidth (torch.sum
over 1 GiB, the same run). K-quants: random valid super-blocks; the others quantized by the gguf package.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import exactspec  # noqa: F401  (sets numba's environment)
from exactspec import kernels as K
from exactspec.kernels import quant as Q
from exactspec.tools.testing import K_QUANT_BLOCKS
from common import read_bandwidth, table

N, KDIM, COPIES = 16384, 2048, 40


def weight(fmt: str) -> K.PackedWeight:
    if fmt in K_QUANT_BLOCKS:
        q = Q.from_blocks(K_QUANT_BLOCKS[fmt](N, KDIM, seed=0), fmt, N, KDIM)
    else:  # an eighth quantized, repeated (the gguf package's quantizer is slow)
        rng = np.random.default_rng(0)
        q = Q.concat([Q.quantize((rng.standard_normal((N // 8, KDIM)) * 0.02).astype(np.float32), fmt)] * 8)
    return K.pack_quant(q, None, int_dot=True)


def stream(fmt: str, rows: int, repeat: int) -> tuple[float, int]:
    """(median seconds per call, bytes per weight) over COPIES distinct copies."""
    w = weight(fmt)
    pool = np.empty((COPIES,) + w.data.shape, w.data.dtype)
    pool[:] = w.data
    ws = [K.PackedWeight(pool[c], w.n, w.k, w.bias) for c in range(COPIES)]
    x = torch.randn(rows, KDIM, generator=torch.Generator().manual_seed(0))
    for c in range(COPIES):
        K.linear(x, ws[c])
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        for c in range(COPIES):
            K.linear(x, ws[c])
        ts.append((time.perf_counter() - t) / COPIES)
    return statistics.median(ts), w.data.nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["q4_k", "q6_k", "q4_1", "q8_0"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 5])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    K.set_num_threads(a.threads)
    bw = read_bandwidth()
    out = []
    for fmt in a.formats:
        for m in a.rows:
            t, nb = stream(fmt, m, a.repeat)
            out.append([fmt, m, f"{nb / 1e6:.1f}", f"{t * 1e3:.3f}", f"{nb / t / 1e9:.1f}", f"{nb / t / bw:.0%}"])
    table(["format", "rows", "MB", "ms per call", "GB/s", "of torch.sum's"], out,
          f"(16384, 2048) weights streamed, {a.threads} threads; torch.sum reads {bw / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
