"""Attention in transformers' tensor layouts, for patched transformers models (exactspec.hf): the
same per-row arithmetic as the engine's attention (kernels.attention.attend_into), under a mask."""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from ..kernels.attention import attend_into
from ..kernels.threads import SERIAL_WORK, TwoBuilds


_ONE_BLOCK = np.zeros(1, np.int32)


@njit(parallel=True, cache=True, nogil=True)
def _masked_attention(q, kt, v, mask, scale, out):
    # q (B, Hq, T, D); kt (B, Hkv, D, S); v (B, Hkv, S, D); mask (B or 1, T, S) uint8, 1 = attend;
    # out (B, T, Hq, D). Query row t attends the keys its mask row allows, in ascending cache index
    # (scored over [first, last] allowed key only). So a row's result depends on its own query, its
    # visible keys and their order alone, and equals `_attention`'s for the same keys.
    B, Hq, T, D = q.shape
    S = kt.shape[3]
    grp = Hq // kt.shape[1]
    for task in prange(B * Hq * T):
        b = task // (Hq * T)
        h = (task // T) % Hq
        t = task % T
        mrow = mask[b if mask.shape[0] > 1 else 0, t]
        lo = 0
        while lo < S and mrow[lo] == 0:
            lo += 1
        if lo == S:
            out[b, t, h, :] = 0.0  # a row that may attend nothing (a padding query): zeros
            continue
        hi = S - 1
        while mrow[hi] == 0:
            hi -= 1
        g = h // grp  # the sequence's keys as one block of S (the paged kernel's arithmetic, same bits)
        attend_into(q[b, h, t], kt[b, g:g + 1], v[b, g:g + 1], _ONE_BLOCK, lo, hi + 1 - lo, mrow, scale, out[b, t, h])
    return out


_MASKED_ATTENTION = TwoBuilds(_masked_attention)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: np.ndarray,
                     scale: float) -> torch.Tensor:
    """transformers layout: q (B, Hq, T, D), k/v (B, Hkv, S, D) float32, mask (B or 1, T, S) uint8
    C-contiguous (1 = attend) -> (B, T, Hq, D) float32."""
    B, Hq, T, D = q.shape
    out = torch.empty(B, T, Hq, D)
    if out.numel():
        kt = k.transpose(2, 3).contiguous()
        work = B * Hq * T * D * k.shape[2] * 2
        _MASKED_ATTENTION.run(work, SERIAL_WORK, q.contiguous().numpy(), kt.numpy(), v.contiguous().numpy(), mask,
                              np.float32(scale), out.numpy())
    return out
