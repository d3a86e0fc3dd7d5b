"""Our attention kernel vs torch's scaled_dot_product_attention (oneDNN/MKL), side by side, on
SmolLM2-135M's head shape (9 query heads, 3 KV heads, head dim 64): R new rows of one sequence
attending its paged cache of `ctx` positions, as a verify step of R - 1 drafts does in every layer.

    python bench/attention.py [--threads 1 2] [--ctx 64 300 1000] [--rows 1 5 9] [--reps 30]

torch gets the same keys as contiguous tensors (no paging) and a causal mask for the R rows; the
times are medians. Ours: exact and invariant (kernels/attention.py, attnvec.py, expf.py); torch: a
different rounding per row count, which is why we do not use it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import exactspec  # noqa: F401  (sets numba's environment)
from exactspec import kernels as K
from exactspec.model.cache import KVCache

from common import table

HQ, HKV, D = 9, 3, 64


def _median(f, reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ctx", type=int, nargs="+", default=[64, 300, 1000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9])
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    out = []
    for th in a.threads:
        K.set_num_threads(th)
        for ctx in a.ctx:
            T = ctx + max(a.rows)
            cache = KVCache(1, 1, HKV, D, T)
            k, v = torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D, generator=g)
            pos_all = torch.arange(T)
            cache.reserve(np.zeros(T, np.int64), pos_all.numpy())
            for j in range(T):  # keys transposed per block (D, BLOCK), values (BLOCK, D)
                b, o = cache.table[0, j // K.BLOCK], j % K.BLOCK
                cache.k[0][:, b, :, o] = k[j]
                cache.v[0][:, b, o] = v[j]
            for R in a.rows:
                q = torch.randn(R, HQ, D, generator=g)
                slot, pos = torch.zeros(R, dtype=torch.int64), torch.arange(ctx, ctx + R)
                ours = _median(lambda: K.attention(q, cache.k[0], cache.v[0], cache.table, slot, pos, D ** -0.5), a.reps)
                n = ctx + R
                kk = k[:n].transpose(0, 1).repeat_interleave(HQ // HKV, 0)  # (HQ, n, D)
                vv = v[:n].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
                mask = torch.arange(n)[None, :] <= pos[:, None]  # (R, n)
                qq = q.transpose(0, 1)  # (HQ, R, D)
                theirs = _median(lambda: F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask), a.reps)
                out.append((th, ctx, R, f"{ours * 1e6:.0f}", f"{theirs * 1e6:.0f}", f"{ours / theirs:.2f}",
                            f"{ours / R * 1e6:.1f}"))
    table(["threads", "ctx", "rows", "ours us", "torch us", "ours/torch", "ours us/row"], out,
          "attention of R rows over ctx cached positions (one layer, SmolLM2 heads)")


if __name__ == "__main__":
    main()
