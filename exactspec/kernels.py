"""Batch-invariant CPU kernels (numba), each with a plain torch reference twin.

Contract: every floating-point reduction here runs in an order fixed by the row's own data and
the model's shape, never by the number of rows in the call, the batch, the cache length, the
thread count or the CPU. How that is achieved:

* No `fastmath`: LLVM may not reassociate, and may not contract a multiply and an add into an FMA
  on its own, so the order written in the source *is* the order computed, whatever the compiler
  vectorizes.
* FMA only where the source says so: the linear kernel's register tile (tile.py) calls
  `llvm.fma` explicitly. An FMA is one correctly rounded IEEE operation, the same bits with or
  without an FMA unit (LLVM falls back to libm's fmaf), so it is as exact as a mul then an add,
  and it halves the vector ops. Allowed because every output is the *same* chain,
  acc = fma(x[m, k], w[n, k], acc) for k = 0, 1, ..., K-1 from +0.0, for every row count, tile
  height, thread count and vector width. `linear_ref` computes that chain in plain torch (a
  round-to-odd float64 FMA, `fma_ref`) and matches it bitwise; tests also compile the kernels for
  other CPUs (tests/test_cross_cpu.py) and check a golden record (tests/golden.json).
* Vectorization only across independent outputs (lanes), never along a reduction: a wider or
  narrower vector (SSE, AVX2, AVX-512) splits lanes differently but never changes a lane's chain.
* Threads (numba prange) split outputs: weight blocks, rows, (row, head) pairs. One output is
  always computed by one thread, start to end.
* Transcendentals (exp) are scalar libm calls in loops indexed by a row's own positions, so an
  element never switches between a vector body and a scalar tail. SVML is disabled in
  `exactspec/__init__.py` before numba is imported.
* Everything except the linear kernel (norms, attention, rope, softmax) uses plain mul and add.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import njit, prange

from . import quant, tile
from .errors import InvalidRequest

MR_MAX = tile.MR_MAX  # rows per register tile on this target (speed only, never the bits)
NL = tile.NL  # output lanes per packed weight block


def set_num_threads(n: int) -> None:
    """Threads for our kernels and for torch's (elementwise) ops. Results do not depend on it."""
    most = numba.config.NUMBA_NUM_THREADS
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise InvalidRequest(f"threads={n!r}: must be an integer from 1 to {most} (numba's thread pool; "
                             "NUMBA_NUM_THREADS raises it)", "threads")
    numba.set_num_threads(n)
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# Linear: y[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], +0.0)) (+ b[n]):
# one FMA chain per output, k ascending (tile.py). Threads split output blocks.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackedWeight:
    """A (N, K) weight packed as (ceil(N/NL), K, NL) so each thread task reads one contiguous block.

    `data` is float32, or uint16 holding bfloat16 bits (widened exactly in the kernel), or a
    quantized format kept quantized (`pack_quant`, dequantized in registers): per block and group of
    32 k's, the quants (k-major, lane-minor) then the lanes' float16 scales (and minimums); Q8_0 as
    uint8 (ceil(N/NL), K/32, tile.GROUP_BYTES), the 4-bit formats as records (ceil(N/NL), K/32) whose one
    field names the format (tile.record_dtype). `bias` is float32 (N,) or an empty array.
    """
    data: np.ndarray
    n: int
    k: int
    bias: np.ndarray

    @property
    def fmt(self) -> str:
        """"f32", "bf16", or the quantized format (quant.FORMATS)."""
        dt = self.data.dtype
        if dt.names:
            return dt.names[0]
        return {np.dtype(np.float32): "f32", np.dtype(np.uint16): "bf16", np.dtype(np.uint8): "q8_0"}[dt]

    @property
    def quantized(self) -> bool:
        return self.fmt in quant.FORMATS

    def unpack(self) -> torch.Tensor:
        """(N, K) float32: the weight as the kernel sees it (for references and tests)."""
        d = self.data
        if self.quantized:
            return torch.from_numpy(_unpack_quant(d, self.fmt).dequantize()[: self.n])
        if self.fmt == "bf16":
            d = (d.astype(np.uint32) << 16).view(np.float32)
        return torch.from_numpy(np.ascontiguousarray(d.transpose(0, 2, 1).reshape(-1, self.k)[: self.n]))


def pack_weight(w: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """Pack a (N, K) float32 or bfloat16 tensor. Zero-pads N up to a multiple of NL."""
    n, k = w.shape
    nblk = (n + NL - 1) // NL
    if w.dtype == torch.bfloat16:
        src, dt = w.contiguous().view(torch.int16).numpy().view(np.uint16), np.uint16
    elif w.dtype == torch.float32:
        src, dt = w.contiguous().numpy(), np.float32
    else:
        raise TypeError(f"pack_weight: dtype {w.dtype} (float32 or bfloat16 expected)")
    padded = np.zeros((nblk * NL, k), dt)
    padded[:n] = src
    data = np.ascontiguousarray(padded.reshape(nblk, NL, k).transpose(0, 2, 1))  # (nblk, K, NL)
    b = np.empty(0, np.float32) if bias is None else bias.float().contiguous().numpy().copy()
    return PackedWeight(data, n, k, b)


def _lanes(a: np.ndarray, nblk: int) -> np.ndarray:
    """(n, G) per-row group values -> (nblk, G, NL): zero-padded to nblk*NL rows, lane-minor."""
    p = np.zeros((nblk * NL,) + a.shape[1:], a.dtype)
    p[: a.shape[0]] = a
    return p.reshape(nblk, NL, -1).transpose(0, 2, 1)


def pack_quant(w: quant.Quantized, bias: torch.Tensor | None = None) -> PackedWeight:
    """Pack a quantized weight kept quantized (tile.FORMATS: quants k-major and lane-minor, then the
    lanes' float16 scales, then minimums). Zero-pads N up to a multiple of NL (scale 0)."""
    n, k = w.shape
    if k % tile.QK:
        raise ValueError(f"pack_quant: rows of {k} are not whole groups of {tile.QK}")
    F = tile.FORMATS[w.fmt]
    nblk, G = (n + NL - 1) // NL, k // tile.QK
    data = np.empty((nblk, G, F.group_bytes), np.uint8)
    q = _lanes(w.q.reshape(n, k).view(np.uint8), nblk).reshape(nblk, G, tile.QK, NL)  # (nblk, G, QK, NL)
    if F.qbits == 4:  # byte j of a k-row: lane j low nibble, lane j + 16 high nibble
        q = q[..., : NL // 2] | (q[..., NL // 2:] << 4)
    data[:, :, :F.d_at] = q.reshape(nblk, G, F.d_at)
    data[:, :, F.d_at: F.m_at] = _lanes(w.d, nblk).copy().view(np.uint8).reshape(nblk, G, 2 * NL)
    if F.has_min:
        data[:, :, F.m_at: F.sc_at] = _lanes(w.m, nblk).copy().view(np.uint8).reshape(nblk, G, 2 * NL)
    if F.sub_scales:
        data[:, :, F.sc_at: F.mn_at] = _lanes(w.sc, nblk)
        data[:, :, F.mn_at:] = _lanes(w.mn, nblk)
    if F.qbits == 4:
        data = data.view(tile.record_dtype(w.fmt))[:, :, 0]
    b = np.empty(0, np.float32) if bias is None else bias.float().contiguous().numpy().copy()
    return PackedWeight(data, n, k, b)


def _unpack_quant(data: np.ndarray, fmt: str) -> quant.Quantized:
    """pack_quant's inverse (all nblk*NL rows)."""
    F = tile.FORMATS[fmt]
    raw = np.ascontiguousarray(data).view(np.uint8)
    nblk, G = data.shape[:2]
    raw = raw.reshape(nblk, G, F.group_bytes)
    q = raw[:, :, :F.d_at].reshape(nblk, G, tile.QK, F.row_bytes)
    if F.qbits == 4:
        q = np.concatenate([q & 15, q >> 4], axis=3)
    else:
        q = q.view(np.int8)

    def rows(a):  # (nblk, G, X, NL) -> (nblk*NL, G*X)
        return np.ascontiguousarray(a.transpose(0, 3, 1, 2)).reshape(nblk * NL, -1)
    d = rows(raw[:, :, F.d_at: F.m_at].copy().view(np.float16)[:, :, None, :])
    m = rows(raw[:, :, F.m_at: F.sc_at].copy().view(np.float16)[:, :, None, :]) if F.has_min else None
    sc = rows(raw[:, :, None, F.sc_at: F.mn_at]) if F.sub_scales else None
    mn = rows(raw[:, :, None, F.mn_at:]) if F.sub_scales else None
    return quant.Quantized(fmt, rows(q), d, m, sc, mn)


# _linear_block's epilogues: y = x @ w.T + bias; y += that (a residual); or, on interleaved gate/up
# blocks (gate block c at 2c, up block c at 2c + 1, bias (2I,) gate then up), y = silu(gate) * up
# with silu_mul's expression.
STORE, ADD, SWIGLU = 0, 1, 2


@njit(inline="always")
def _tile_height(M, m0, i, ntiles):
    # Rows of tile i when M rows are split into ntiles tiles as evenly as possible (11 -> 6 + 5).
    return (M - m0 + ntiles - i - 1) // (ntiles - i)


@njit(inline="always")
def _linear_block(x, w, bias, y, b, mode):
    # Output block b (NL columns of y) for every row of x, in tiles of at most MR_MAX rows: each
    # weight vector is read once per tile, the rows' chains never mix.
    M = x.shape[0]
    n0 = b * NL
    nb = min(NL, y.shape[1] - n0)
    buf = np.empty((2, MR_MAX, NL), np.float32)
    t = buf[0]
    u = buf[1]  # SWIGLU: the up half
    ntiles = (M + MR_MAX - 1) // MR_MAX
    m0 = 0
    for i in range(ntiles):
        mr = _tile_height(M, m0, i, ntiles)
        if mode == SWIGLU:
            tile.run_tile(mr, x, m0, w, 2 * b, t)
            tile.run_tile(mr, x, m0, w, 2 * b + 1, u)
        else:
            tile.run_tile(mr, x, m0, w, b, t)
        for m in range(mr):
            for j in range(nb):
                v = t[m, j]
                if bias.shape[0] > 0:
                    v = v + bias[n0 + j]
                if mode == SWIGLU:
                    uv = u[m, j]
                    if bias.shape[0] > 0:
                        uv = uv + bias[y.shape[1] + n0 + j]
                    y[m0 + m, n0 + j] = v / (np.float32(1.0) + np.float32(math.exp(-v))) * uv
                elif mode == ADD:
                    y[m0 + m, n0 + j] = y[m0 + m, n0 + j] + v
                else:
                    y[m0 + m, n0 + j] = v
        m0 += mr


@njit(parallel=True, cache=True)
def _linear(x, w, bias, y):
    for b in prange(w.shape[0]):
        _linear_block(x, w, bias, y, b, STORE)
    return y


class TwoBuilds:
    """A parallel kernel and the same source compiled without threads, for calls too small to pay
    a thread-pool wake-up: `run(work, limit, *args)` takes the serial build below `limit`
    multiply-adds. Without fastmath the compiler must keep every rounding as written, so the two
    builds give the same bits (tests compare rows across the switch).

    The serial copy gets its own name: numba's disk cache keys entries by function name, line and
    signature, not by the `parallel` flag, so a same-named serial build would load the cached
    parallel machine code (or the reverse)."""

    def __init__(self, parallel_kernel):
        f = parallel_kernel.py_func
        g = types.FunctionType(f.__code__, f.__globals__, f.__name__ + "_serial", f.__defaults__, f.__closure__)
        g.__qualname__ = f.__qualname__ + "_serial"
        self.parallel, self.serial = parallel_kernel, njit(cache=True)(g)

    def run(self, work: int, limit: int, *args):
        return (self.serial if work < limit else self.parallel)(*args)


_LINEAR = TwoBuilds(_linear)
SERIAL_WORK = 1 << 18  # multiply-adds below which a call runs on the calling thread (~30 us)


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


def fma_ref(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 a * b + c (IEEE fusedMultiplyAdd), in plain torch.

    a * b is exact in float64 (24 + 24 bits < 53); the sum is computed in float64 with round-to-odd
    (TwoSum gives its exact error; an inexact even result steps one ulp towards the error), and a
    round-to-odd value with >= 2 extra bits rounds to float32 exactly as the exact sum would."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of `linear`: the same chain per output, acc = fma(x[:, k], w[:, k], acc), k ascending."""
    w = w.float()
    y = torch.zeros(x.shape[0], w.shape[0])
    for k in range(w.shape[1]):
        y = fma_ref(x[:, k:k + 1].expand_as(y), w[:, k].expand_as(y), y)
    return y if bias is None else y + bias.float()


# ---------------------------------------------------------------------------------------------
# RMSNorm over rows: y = x / sqrt(mean(x^2) + eps) * w. Sum of squares in index order.
# ---------------------------------------------------------------------------------------------

@njit(inline="always")
def _rms_row(x, w, eps, y):
    # One row: y = w * (x * r), r = 1 / sqrt(sum(x^2) / H + eps), the sum in index order.
    H = x.shape[0]
    ss = np.float32(0.0)
    for i in range(H):
        ss += x[i] * x[i]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(H) + eps)
    for i in range(H):
        y[i] = w[i] * (x[i] * r)


# Serial: a row is tiny work, and a thread-pool wake-up costs more than it. (Serial or parallel
# compile the same source without fastmath, so the bits are the same either way.)
@njit(cache=True)
def _rmsnorm(x, w, eps, y):
    for m in range(x.shape[0]):
        _rms_row(x[m], w, eps, y[m])
    return y


def rmsnorm_np(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (M, H) float32 C-contiguous, w (H,) float32 -> (M, H)."""
    y = np.empty_like(x)
    if x.shape[0]:
        _rmsnorm(x, w, np.float32(eps), y)
    return y


def rmsnorm(x: torch.Tensor, w: np.ndarray, eps: float) -> torch.Tensor:
    """x (M, H) float32, w (H,) float32 -> (M, H)."""
    return torch.from_numpy(rmsnorm_np(x.contiguous().numpy(), w, eps))


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    ss = torch.zeros(x.shape[0])
    for i in range(x.shape[1]):
        ss = ss + x[:, i] * x[:, i]
    # divide by a tensor: torch turns division by a Python scalar into a reciprocal multiply
    # (and `1.0 / t` into a reciprocal): keep every operand a full tensor. torch.sqrt on float32 is
    # not correctly rounded on this CPU; sqrt in float64 rounded to float32 is.
    var = ss / torch.full_like(ss, x.shape[1]) + torch.full_like(ss, eps)
    r = torch.ones_like(ss) / torch.sqrt(var.double()).float()
    return w * (x * r[:, None])


# ---------------------------------------------------------------------------------------------
# SwiGLU: gate_up (M, 2I) -> silu(gate) * up (M, I), one row at a time over the fixed width I.
# ---------------------------------------------------------------------------------------------

@njit(cache=True)
def _silu_mul(gu, y):
    M, I2 = gu.shape
    half = I2 // 2
    for m in range(M):
        for i in range(half):
            g = gu[m, i]
            y[m, i] = g / (np.float32(1.0) + np.float32(math.exp(-g))) * gu[m, half + i]
    return y


def silu_mul_np(gu: np.ndarray) -> np.ndarray:
    y = np.empty((gu.shape[0], gu.shape[1] // 2), np.float32)
    if gu.shape[0]:
        _silu_mul(gu, y)
    return y


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(silu_mul_np(gu.contiguous().numpy()))


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


# ---------------------------------------------------------------------------------------------
# After the qkv projection: optional per-head q/k RMSNorm (Qwen3), rotary embedding of q and k
# from the position's table row, and the cache write of k and v. Elementwise mul/add only
# (no FMA), the same arithmetic as transformers' `x * cos + rotate_half(x) * sin`.
# ---------------------------------------------------------------------------------------------

@njit(inline="always")
def _rope_head(x, c, s, out):
    half = x.shape[0] // 2
    for i in range(half):
        out[i] = x[i] * c[i] + (-x[half + i]) * s[i]
        out[half + i] = x[half + i] * c[half + i] + x[i] * s[half + i]


@njit(cache=True)
def _qkv_rope_cache(qkv, Hq, Hkv, D, q_norm, k_norm, eps, cos, sin, slot, pos, kt, v, q_out):
    tmp = np.empty(D, np.float32)
    kr = np.empty(D, np.float32)
    for r in range(qkv.shape[0]):
        p = pos[r]
        c = cos[p]
        sn = sin[p]
        row = qkv[r]
        for h in range(Hq):
            x = row[h * D:(h + 1) * D]
            if q_norm.shape[0] > 0:
                _rms_row(x, q_norm, eps, tmp)
                x = tmp
            _rope_head(x, c, sn, q_out[r, h])
        for g in range(Hkv):
            x = row[(Hq + g) * D:(Hq + g + 1) * D]
            if k_norm.shape[0] > 0:
                _rms_row(x, k_norm, eps, tmp)
                x = tmp
            _rope_head(x, c, sn, kr)
            for d in range(D):
                kt[slot[r], g, d, p] = kr[d]
            v[slot[r], g, p, :] = row[(Hq + Hkv + g) * D:(Hq + Hkv + g + 1) * D]
    return q_out


def qkv_rope_cache(qkv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, q_norm: np.ndarray,
                   k_norm: np.ndarray, eps: float, cos: torch.Tensor, sin: torch.Tensor, slot: torch.Tensor,
                   pos: torch.Tensor, kt: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """qkv (R, (Hq + 2 Hkv) D) -> rotated q (R, Hq, D); writes rotated k and v into kt (S, Hkv, D, C)
    and v (S, Hkv, C, D) at (slot, pos). q_norm / k_norm: (D,) weights or empty arrays."""
    q = torch.empty(qkv.shape[0], n_heads, head_dim)
    if qkv.shape[0]:
        _qkv_rope_cache(qkv.contiguous().numpy(), n_heads, n_kv, head_dim, q_norm, k_norm, np.float32(eps),
                        cos.numpy(), sin.numpy(), slot.numpy(), pos.numpy(), kt.numpy(), v.numpy(), q.numpy())
    return q


# ---------------------------------------------------------------------------------------------
# Attention of each new row over its own sequence's cache.
# Row r (slot s, position p) attends to keys j in [max(0, p - window + 1), p]: the set and the
# order depend on p alone, never on the cache length or capacity or the other rows.
# Scores are vectorized across keys (k cache stored transposed, (D, C)), summed over d in order;
# softmax max is exact; exp sum and the weighted sum of values run over j ascending.
# ---------------------------------------------------------------------------------------------

_ALL = np.empty(0, np.uint8)  # "no mask": every key in the range is attended


@njit(inline="always")
def _attend(qv, kk, vv, j0, n, mrow, scale, o):
    # One query row over keys j0 .. j0+n-1 of kk (D, C) and vv (C, D); mrow (C,) uint8 with
    # 1 = attend, or empty = all. Scores summed over d in order, vectorized across keys; exact max;
    # exp, its sum and the weighted sum of values over keys ascending. Keys the mask excludes are
    # scored but never enter the max, the sum or the output.
    every = mrow.shape[0] == 0
    sc = np.zeros(n, np.float32)
    for d in range(qv.shape[0]):
        qd = qv[d]
        krow = kk[d]
        for j in range(n):
            sc[j] += qd * krow[j0 + j]
    mx = np.float32(-np.inf)
    for j in range(n):
        sc[j] = sc[j] * scale
        if (every or mrow[j0 + j] != 0) and sc[j] > mx:
            mx = sc[j]
    o[:] = 0.0
    l = np.float32(0.0)
    for j in range(n):
        if every or mrow[j0 + j] != 0:
            e = np.float32(math.exp(sc[j] - mx))
            l += e
            vr = vv[j0 + j]
            for d in range(o.shape[0]):
                o[d] += e * vr[d]
    for d in range(o.shape[0]):
        o[d] = o[d] / l


@njit(inline="always")
def _attend_task(t, q, kt, v, slot, pos, scale, window, out):
    # Task t = (row r, query head h): row r at position p of slot s over its keys j0..p.
    Hq = q.shape[1]
    r = t // Hq
    h = t % Hq
    s = slot[r]
    p = pos[r]
    j0 = 0
    if window > 0 and p - window + 1 > 0:
        j0 = p - window + 1
    g = h // (Hq // kt.shape[1])
    _attend(q[r, h], kt[s, g], v[s, g], j0, p + 1 - j0, _ALL, scale, out[r, h])


@njit(parallel=True, cache=True)
def _attention(q, kt, v, slot, pos, scale, window, out):
    for t in prange(q.shape[0] * q.shape[1]):
        _attend_task(t, q, kt, v, slot, pos, scale, window, out)
    return out


_ATTENTION = TwoBuilds(_attention)


def attention(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
              scale: float, window: int = 0) -> torch.Tensor:
    """q (R, Hq, D); kt (S, Hkv, D, C); v (S, Hkv, C, D); slot, pos (R,) int64 -> (R, Hq, D)."""
    out = torch.empty_like(q)
    if q.shape[0]:
        R, Hq, D = q.shape
        work = R * Hq * D * (int(pos.max()) + 1) * 2
        _ATTENTION.run(work, SERIAL_WORK, q.contiguous().numpy(), kt.numpy(), v.numpy(), slot.numpy(), pos.numpy(),
                       np.float32(scale), window, out.numpy())
    return out


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """One sequence, float64: q (T, Hq, D) at positions 0..T-1, k/v (T, Hkv, D)."""
    T, Hq, D = q.shape
    grp = Hq // k.shape[1]
    k = k.double().repeat_interleave(grp, dim=1)
    v = v.double().repeat_interleave(grp, dim=1)
    s = torch.einsum("thd,jhd->htj", q.double(), k) * scale
    i = torch.arange(T)
    mask = i[None, :] > i[:, None]
    if window > 0:
        mask |= i[None, :] <= i[:, None] - window
    s = s.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("htj,jhd->thd", s, v).float()


# ---------------------------------------------------------------------------------------------
# Row-wise softmax pieces for sampling: max, exp and sums in index order, one row per thread.
# ---------------------------------------------------------------------------------------------

@njit(inline="always")
def _row_max(r):
    mx = np.float32(-np.inf)
    for i in range(r.shape[0]):
        if r[i] > mx:
            mx = r[i]
    return mx


@njit(parallel=True, cache=True)
def _softmax(x, y):
    for m in prange(x.shape[0]):
        mx = _row_max(x[m])
        s = np.float32(0.0)
        for i in range(x.shape[1]):
            e = np.float32(math.exp(x[m, i] - mx))  # exp(-inf) = 0 for filtered tokens
            y[m, i] = e
            s += e
        for i in range(x.shape[1]):
            y[m, i] = y[m, i] / s
    return y


@njit(parallel=True, cache=True)
def _log_softmax(x, y):
    for m in prange(x.shape[0]):
        mx = _row_max(x[m])
        s = np.float32(0.0)
        for i in range(x.shape[1]):
            s += np.float32(math.exp(x[m, i] - mx))
        ls = np.float32(math.log(s))
        for i in range(x.shape[1]):
            y[m, i] = (x[m, i] - mx) - ls
    return y


def _rows(kern, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.shape[0]:
        kern(x.numpy(), y.numpy())
    return y


def softmax(x: torch.Tensor) -> torch.Tensor:
    """(M, V) float32 -> probabilities. A row of all -inf is not allowed (NaN)."""
    return _rows(_softmax, x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """(M, V) float32 -> log-probabilities (-inf stays -inf)."""
    return _rows(_log_softmax, x)


@njit(cache=True)
def _cumsum(x, y):
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += x[i]
        y[i] = s
    return y


def cumsum(x: torch.Tensor) -> torch.Tensor:
    """1-D float32 running sum in index order (torch.cumsum may split the scan across threads)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    _cumsum(x.numpy(), y.numpy())
    return y


# ---------------------------------------------------------------------------------------------
# Rotary tables: one entry per position, computed by scalar libm cos/sin, so an entry never
# depends on how long the table is.
# ---------------------------------------------------------------------------------------------

@njit(cache=True)
def _rope_table(inv_freq, n_pos, cos, sin):
    half = inv_freq.shape[0]
    for p in range(n_pos):
        for i in range(half):
            f = np.float32(p) * inv_freq[i]  # float32 product, as transformers computes it
            c = np.float32(math.cos(np.float64(f)))
            s = np.float32(math.sin(np.float64(f)))
            cos[p, i] = c
            cos[p, half + i] = c
            sin[p, i] = s
            sin[p, half + i] = s
    return cos


def rope_table(inv_freq: torch.Tensor, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_freq (D/2,) float32 -> cos, sin (n_pos, D) float32 (halves repeated, HF layout)."""
    d = 2 * inv_freq.shape[0]
    cos = torch.empty(n_pos, d)
    sin = torch.empty(n_pos, d)
    _rope_table(inv_freq.float().contiguous().numpy(), n_pos, cos.numpy(), sin.numpy())
    return cos, sin


# ---------------------------------------------------------------------------------------------
# Kernels for patched transformers models (exactspec.hf), in transformers' tensor layouts.
# ---------------------------------------------------------------------------------------------

@njit(parallel=True, cache=True)
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
        _attend(q[b, h, t], kt[b, h // grp], v[b, h // grp], lo, hi + 1 - lo, mrow, scale, out[b, t, h])
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
