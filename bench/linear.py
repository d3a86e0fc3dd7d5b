"""Our batch-invariant linear kernel vs torch's F.linear (MKL/oneDNN), measured side by side.

    python bench/linear.py [--threads 2] [--reps 15]

For each shape (K -> N), weight dtype and row count M, prints the median time of each and the
ratio ours/torch (< 1: we are faster). Weights rotate through a pool larger than the L3 cache,
as in a real forward where every layer's weights come from memory; the M=1 line also shows the
bandwidth reached against the machine's measured read bandwidth (torch.sum over 1 GiB).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import exactspec  # noqa: F401  (sets numba's environment)
from exactspec import kernels as K
from common import read_bandwidth

SHAPES = [(896, 1152), (896, 896), (896, 4864), (4864, 896), (896, 32000)]
MS = [1, 2, 4, 5, 8, 9, 16]


def _times(f, reps: int, copies: int) -> list[float]:
    time.sleep(0.3)
    ts = []
    for r in range(reps):
        t = time.perf_counter()
        f(r % copies)
        ts.append(time.perf_counter() - t)
    return ts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pool-mb", type=int, default=400, help="weight bytes to rotate through (> L3)")
    a = ap.parse_args()
    K.set_num_threads(a.threads)
    bw = read_bandwidth()
    print(f"threads={a.threads}  read bandwidth (torch.sum, 1 GiB f32): {bw / 1e9:.1f} GB/s")
    print(f"{'shape':>12} {'dtype':>8} {'M':>3} {'torch ms':>9} {'ours ms':>8} {'ours/torch':>10} "
          f"{'ours GB/s':>9} {'of bw':>6}")
    summary = []
    for k, n in SHAPES:
        for dt in (torch.float32, torch.bfloat16):
            nbytes = n * k * (4 if dt == torch.float32 else 2)
            copies = max(2, a.pool_mb * 2 ** 20 // nbytes)
            g = torch.Generator().manual_seed(0)
            ws = [(torch.randn(n, k, generator=g) / k ** 0.5).to(dt) for _ in range(copies)]
            packed = [K.pack_weight(w) for w in ws]
            ours_t = {}
            for m in MS:
                x = torch.randn(m, k)
                xd = x.to(dt)
                K.linear(x, packed[0])
                F.linear(xd, ws[0])
                # Each side in its own batch, with a pause between: torch's OpenMP threads spin for a
                # while after each call and would steal the cores from ours (and ours from torch's).
                tt = _times(lambda i: F.linear(xd, ws[i]), a.reps, copies)
                to = _times(lambda i: K.linear(x, packed[i]), a.reps, copies)
                mo, mt = statistics.median(to), statistics.median(tt)
                ours_t[m] = mo
                gbs = nbytes / mo / 1e9
                print(f"{k:>5}->{n:<6} {str(dt)[6:]:>8} {m:>3} {mt * 1e3:9.3f} {mo * 1e3:8.3f} {mo / mt:10.2f} "
                      f"{gbs:9.1f} {gbs * 1e9 / bw:6.0%}")
            summary.append((k, n, dt, ours_t[5] / ours_t[1], ours_t[9] / ours_t[1]))
            del ws, packed
    print("\ntime(M=5) / time(M=1), time(M=9) / time(M=1), ours:")
    for k, n, dt, r5, r9 in summary:
        print(f"  {k}->{n} {str(dt)[6:]}: {r5:.2f} {r9:.2f}")


if __name__ == "__main__":
    main()
