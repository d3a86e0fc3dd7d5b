"""Int8 activations for the integer-dot layouts (layout.py's "q8_0i", "q4_0i", "q4_1i", "q4_ki").

Each row of x (M, K) is quantized on its own, per block of QK = 32 values (llama.cpp's Q8_0
activations, the scale kept in float32):
    amax = max |x[k]| over the block;  d = amax / 127 (one float32 division);
    q[k] = round-half-to-even(x[k] / d) (one float32 division, then rint), in [-127, 127];
    s = sum q[k] (int32); d = 0 and q = 0 when amax = 0; a block holding a NaN or an infinity gets
    d = NaN (its outputs are NaN, as the float path's would not be finite either).
Division and rint are correctly rounded IEEE operations, so a value's quant is the same in a
vector body or a scalar tail, on any CPU; a row's quants depend on that row alone.

A block's dot product with a weight block is then an integer sum, exact in int32 whatever the
instruction or order (kernels/itile.py). Only the per-group float combine rounds, in one fixed
order per output, groups g ascending from +0.0 (u: the layout's unsigned quants, q8_0 stored + 128):
    q8_0i: acc = fma(f32(sum u*q - 128 s), f32(dw) * dx, acc)
    q4_0i, q5_0i: acc = fma(f32(sum u*q - 8 s (16 s)), f32(dw) * dx, acc)
    q4_1i, q5_1i: acc = fma(f32(sum u*q), f32(dw) * dx, acc); acc = fma(f32(m), dx * f32(s), acc)
    q4_ki, q5_ki: acc = fma(f32(sum u*q), (f32(d) * f32(sc)) * dx, acc);
           acc = fma(-(f32(dmin) * f32(mn)), dx * f32(s), acc)
    q6_ki: per 16 k's h = 0, 1: acc = fma(f32(sum (u - 32) * q), (f32(d) * f32(sc_h)) * dx, acc)
`linear_int_ref` is that, in plain torch (int64 sums, `fma_ref`).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, types
from numba.extending import overload

from .actvec import quantize_groups
from .expf import fma_ref
from .layout import LAYOUTS, QK
from .quant import ZERO


@njit(inline="always")
def _quantize_row(x, q, d, s):
    for g in range(x.shape[0] // QK):
        k0 = g * QK
        amax = np.float32(0.0)
        bad = False
        for k in range(k0, k0 + QK):
            v = abs(x[k])
            if v > amax:
                amax = v
            if not v <= np.float32(3.4028235e38):  # NaN or infinity
                bad = True
        dv = amax / np.float32(127.0)
        tot = np.int32(0)
        for k in range(k0, k0 + QK):
            qi = np.int32(0)
            if dv > np.float32(0.0) and not bad:
                r = np.rint(x[k] / dv)
                qi = np.int32(min(max(r, np.float32(-127.0)), np.float32(127.0)))
            q[k] = np.int8(qi)
            tot += qi
        d[g] = np.float32(np.nan) if bad else dv
        s[g] = tot


@njit(cache=True, nogil=True)
def _quantize_rows(x, q, d, s):
    for m in range(x.shape[0]):
        if x.strides[1] == 4 and q.strides[1] == 1 and d.strides[1] == 4 and s.strides[1] == 4:
            quantize_groups(x[m], q[m], d[m], s[m])  # the same operations as vector code (actvec.py)
        else:
            _quantize_row(x[m], q[m], d[m], s[m])


@njit(cache=True, nogil=True)
def _quantize_rows_scalar(x, q, d, s):
    """_quantize_rows by the scalar loops only (the vector code's twin, for tests)."""
    for m in range(x.shape[0]):
        _quantize_row(x[m], q[m], d[m], s[m])


def quantize_rows(x: np.ndarray, scalar: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (M, K) float32, K a multiple of 32 -> (q (M, K) int8, d (M, K/32) float32, s (M, K/32) int32).
    scalar: by the scalar loops (the twin of the vector code the kernels run)."""
    M, K = x.shape
    q, d, s = np.empty((M, K), np.int8), np.empty((M, K // QK), np.float32), np.empty((M, K // QK), np.int32)
    (_quantize_rows_scalar if scalar else _quantize_rows)(np.ascontiguousarray(x, np.float32), q, d, s)
    return q, d, s


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin of `quantize_rows`."""
    M, K = x.shape
    b = x.float().reshape(M, K // QK, QK)
    amax = b.abs().amax(2)
    bad = ~torch.isfinite(b).all(2)
    d = amax / torch.full_like(amax, 127.0)  # a tensor divisor: torch turns `/ 127.0` into a multiply
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(b / safe[:, :, None]).clamp(-127, 127)  # torch.round: half to even
    q = torch.where(((d > 0) & ~bad)[:, :, None], q, torch.zeros_like(q)).to(torch.int8)
    d = torch.where(bad, torch.full_like(d, float("nan")), d)
    return q.reshape(M, K), d, q.int().sum(2, dtype=torch.int32)


def _is_int_dot(w) -> bool:
    return isinstance(w.dtype, types.Record) and LAYOUTS[next(iter(w.dtype.fields))].int_dot


def acts(x, w, buf):
    """What the tile of weight w takes for the float rows x: x itself, or for an integer-dot layout
    the tuple (q, d, s) of `quantize_rows`, written into the leading columns of buf = `act_buffers`
    (compiled code only)."""


def act_buffers(M, K):
    """Room for `acts` of M rows of up to K values (compiled code only)."""


@overload(act_buffers)
def _act_buffers_impl(M, K):
    def make(M, K):
        return (np.empty((M, K), np.int8), np.empty((M, K // QK), np.float32), np.empty((M, K // QK), np.int32))
    return make


@overload(acts)
def _acts_impl(x, w, buf):
    if _is_int_dot(w):
        def quantized(x, w, buf):
            M, K = x.shape
            q, d, s = buf[0][:M, :K], buf[1][:M, :K // QK], buf[2][:M, :K // QK]
            _quantize_rows(x, q, d, s)
            return (q, d, s)
        return quantized
    return lambda x, w, buf: x


def nrows(x):
    """Rows of what `acts` returned (compiled code only)."""


@overload(nrows)
def _nrows_impl(x):
    if isinstance(x, types.BaseTuple):
        return lambda x: x[0].shape[0]
    return lambda x: x.shape[0]


def linear_int_ref(x: torch.Tensor, w) -> torch.Tensor:
    """Torch twin of `linear` on an integer-dot PackedWeight `w`: x (M, K) float32 -> (M, N). The
    integer sums are taken of the quants less their zero point (the kernel's sum of the stored quants
    less zero * s is the same integer)."""
    F = LAYOUTS[w.fmt]
    Q = w.quants()
    N, K = w.n, w.k
    q, d, s = quantize_rows_ref(x)
    per = QK // 2 if F.sc16 else QK  # k's per integer sum: Q6_K's scales are per 16
    n = K // per
    wq = torch.from_numpy(Q.q[:N].astype(np.int64) - ZERO.get(F.base, 0)).reshape(N, n, per)
    isum = torch.einsum("mgk,ngk->mng", q.long().reshape(-1, n, per), wq)  # exact: int64
    dw = torch.from_numpy(Q.d[:N].astype(np.float32))  # (N, K/32)
    acc = torch.zeros(x.shape[0], N)
    for j in range(n):
        g = j * per // QK
        dx = d[:, g:g + 1]
        scale = dw[None, :, g]
        if F.sc16:  # (d * sc_h) of the half
            scale = scale * torch.from_numpy(Q.sc[:N, j].astype(np.float32))[None, :]
        elif F.sub_scales:
            scale = scale * torch.from_numpy(Q.sc[:N, g].astype(np.float32))[None, :]
        acc = fma_ref(isum[:, :, j].float(), scale * dx, acc)
        if F.has_min:
            m = torch.from_numpy(Q.m[:N, g].astype(np.float32))[None, :]
            if F.sub_scales:
                m = -(m * torch.from_numpy(Q.mn[:N, g].astype(np.float32))[None, :])
            acc = fma_ref(m.expand_as(acc), (dx * s[:, g:g + 1].float()).expand_as(acc), acc)
    return acc if w.bias.shape[0] == 0 else acc + torch.from_numpy(w.bias)
