"""A mixture of experts' routing: each row's top k experts from its router logits, and their weights.

A row's softmax over its E logits (max, exp32 and the sum in expert order, as rows.softmax), its k
largest probabilities picked one by one (ties to the lower expert index, so equal logits route the
same way on every CPU and in every batch), and their weights: the probabilities, or divided by
their sum (norm_topk, the sum taken in the order picked). A function of the row's own logits only.
The experts' outputs are then combined in expert-index order (model/forward.py), never by arrival.
`route_ref` is the plain twin.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from .expf import exp32
from .rows import _row_max, softmax


@njit(inline="always")
def route_into(logits, k, norm, idx, wts):
    """logits (R, E) float32 -> idx (R, k) int64 (picked in order: the largest probability first) and
    wts (R, k) float32."""
    R, E = logits.shape
    p = np.empty(E, np.float32)
    taken = np.empty(E, np.bool_)
    for r in range(R):
        mx = _row_max(logits[r])
        s = np.float32(0.0)
        for e in range(E):
            p[e] = exp32(logits[r, e] - mx)
            s += p[e]
        for e in range(E):
            p[e] = p[e] / s
            taken[e] = False
        total = np.float32(0.0)
        for j in range(k):
            best = -1
            for e in range(E):  # strictly greater: the lower index wins a tie
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            idx[r, j] = best
            wts[r, j] = p[best]
            total += p[best]
        if norm:
            for j in range(k):
                wts[r, j] = wts[r, j] / total


@njit(cache=True, nogil=True)
def _route(logits, k, norm, idx, wts):
    route_into(logits, k, norm, idx, wts)


def route(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, E) float32 router logits -> the experts (R, k) int64 and their weights (R, k) float32."""
    x = logits.contiguous().numpy()
    idx, wts = np.empty((x.shape[0], k), np.int64), np.empty((x.shape[0], k), np.float32)
    _route(x, k, norm, idx, wts)
    return torch.from_numpy(idx), torch.from_numpy(wts)


def route_ref(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: rows.softmax's probabilities, a stable descending sort (ties: lower index first), the
    sum of the k in that order."""
    p = softmax(logits)
    top, idx = torch.sort(p, dim=-1, descending=True, stable=True)
    top, idx = top[:, :k].clone(), idx[:, :k].contiguous()
    if norm:
        for r in range(top.shape[0]):
            total = torch.zeros((), dtype=torch.float32)
            for j in range(k):
                total = total + top[r, j]
            top[r] = top[r] / total
    return idx, top
