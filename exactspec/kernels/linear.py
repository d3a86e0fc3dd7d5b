"""Linear: y[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], +0.0)) (+ b[n]): one FMA
chain per output, k ascending (the register tile, tile.py), for every row count, tile height and
thread count. Threads split output blocks. `linear_ref` is the plain torch twin."""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange
from numba.extending import overload

from . import tile
from .expf import SWIGLU, fma_ref, gated
from .actquant import _is_int_dot, act_buffers, acts, nrows
from .cpu import MR_HALF, MR_INT, MR_MAX
from .layout import NL
from .pack import PackedWeight
from .threads import SERIAL_WORK, TwoBuilds


# linear_block's epilogues: y = x @ w.T + bias; y += that (a residual); or, on interleaved gate/up
# blocks (gate block c at 2c, up block c at 2c + 1, bias (2I,) gate then up), y = silu(gate) * up
# (SWIGLU), or gelu(gate) * up (GEGLU: Gemma), by expf.gated as rows.gated_mul computes them.
STORE, ADD = 0, 1  # (SWIGLU, GEGLU: expf's)
# Rows of a tile's buffer t: a tile's mr rows of outputs, and an AVX2 integer-dot tile's integer accumulators
# between their widens in rows mr .. 2 mr - 1 (itile.ITile.islot).
BUF_ROWS = max(MR_MAX, 2 * MR_INT, 2 * MR_HALF)


@njit(inline="always")
def _tile_height(M, m0, i, ntiles):
    # Rows of tile i when M rows are split into ntiles tiles as evenly as possible (11 -> 6 + 5).
    return (M - m0 + ntiles - i - 1) // (ntiles - i)


def _tile_rows(w):
    """The most rows of a tile for weight w (compiled code only)."""


@overload(_tile_rows)
def _tile_rows_impl(w):
    mr = MR_HALF if tile.halved(tile._format_of(w.dtype)) else MR_INT if _is_int_dot(w) else MR_MAX
    return lambda w: mr


@njit(cache=True, nogil=True)
def linear_block(x, w, bias, y, b, mode):
    # Output block b (NL columns of y) for every row of x (float rows, or for an integer-dot layout
    # actquant.acts's int8 rows), in tiles of at most _tile_rows(w) rows: each weight vector is read
    # once per tile, the rows' chains never mix. A function of its own (not inlined): each parallel
    # loop calls the one compiled copy per weight type (inlined, every loop compiled its own tiles:
    # slower to compile, and prompt processing measured ~1.35x slower).
    M = nrows(x)
    n0 = b * NL
    nb = min(NL, y.shape[1] - n0)
    buf = np.empty((2, BUF_ROWS, NL), np.float32)
    t = buf[0]
    u = buf[1]  # SWIGLU: the up half
    mr_max = _tile_rows(w)
    ntiles = (M + mr_max - 1) // mr_max
    m0 = 0
    for i in range(ntiles):
        mr = _tile_height(M, m0, i, ntiles)
        if mode >= SWIGLU:
            tile.run_tile(mr, x, m0, w, 2 * b, t)
            tile.run_tile(mr, x, m0, w, 2 * b + 1, u)
        else:
            tile.run_tile(mr, x, m0, w, b, t)
        for m in range(mr):
            for j in range(nb):
                v = t[m, j]
                if bias.shape[0] > 0:
                    v = v + bias[n0 + j]
                if mode >= SWIGLU:
                    uv = u[m, j]
                    if bias.shape[0] > 0:
                        uv = uv + bias[y.shape[1] + n0 + j]
                    y[m0 + m, n0 + j] = gated(v, uv, mode)
                elif mode == ADD:
                    y[m0 + m, n0 + j] = y[m0 + m, n0 + j] + v
                else:
                    y[m0 + m, n0 + j] = v
        m0 += mr


@njit(inline="always")
def block(x, w, bias, y, b, mode):
    # linear_block with its incidental argument types made one: the block index int64 (a parallel loop's
    # index is uint64, a serial one's int64), the mode a plain int64 (a constant would be a literal type),
    # y of any layout ('A': a column slice and a whole array alike), so each weight type compiles one
    # linear_block that every caller, parallel or serial build, shares (was up to 10 per weight type).
    linear_block(x, w, bias, y[:, :y.shape[1]], np.int64(b), np.int64(mode))


@njit(parallel=True, cache=True, nogil=True)
def _linear(x, w, bias, y):
    xa = acts(x, w, act_buffers(x.shape[0], x.shape[1]))
    for b in prange(w.shape[0]):
        block(xa, w, bias, y, b, STORE)
    return y


_LINEAR = TwoBuilds(_linear)


def linear_np(x: np.ndarray, w: PackedWeight) -> np.ndarray:
    """x (M, K) float32 C-contiguous -> (M, N) float32."""
    y = np.empty((x.shape[0], w.n), np.float32)
    if x.shape[0]:
        if w.k == 0:  # an empty chain: +0.0 (+ bias), as the twin
            y[:] = w.bias if w.bias.shape[0] else 0.0
            return y
        _LINEAR.run(x.shape[0] * w.n * w.k, SERIAL_WORK, x, w.data, w.bias, y)
    return y


def linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) float32."""
    return torch.from_numpy(linear_np(x.contiguous().numpy(), w))


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of `linear`: the same chain per output, acc = fma(x[:, k], w[:, k], acc), k ascending.
    (Integer-dot layouts: actquant.linear_int_ref.)"""
    w = w.float()
    y = torch.zeros(x.shape[0], w.shape[0])
    for k in range(w.shape[1]):
        y = fma_ref(x[:, k:k + 1].expand_as(y), w[:, k].expand_as(y), y)
    return y if bias is None else y + bias.float()
