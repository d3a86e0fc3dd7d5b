"""Row kernels: RMSNorm, SwiGLU, q/k norm + rotary + cache write, rotary tables, softmax,
log-softmax, cumsum. Each reduction runs over a row's own elements in index order; each
transcendental is a scalar libm call indexed by the row's own positions. Each has a torch twin."""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from .attention import as_numpy, kv_store
from .expf import GEGLU, SWIGLU, exp32, gated, gelu32_ref


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
@njit(cache=True, nogil=True)
def rmsnorm_into(x, w, eps, y):
    for m in range(x.shape[0]):
        _rms_row(x[m], w, eps, y[m])
    return y


def rmsnorm_np(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (M, H) float32 C-contiguous, w (H,) float32 -> (M, H)."""
    y = np.empty_like(x)
    if x.shape[0]:
        rmsnorm_into(x, w, np.float32(eps), y)
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

@njit(cache=True, nogil=True)
def _gated_mul(gu, y, mode):
    M, I2 = gu.shape
    half = I2 // 2
    for m in range(M):
        for i in range(half):
            y[m, i] = gated(gu[m, i], gu[m, half + i], mode)
    return y


def gated_mul_np(gu: np.ndarray, mode: int = SWIGLU) -> np.ndarray:
    """gate_up (M, 2I) -> act(gate) * up (M, I): silu (SWIGLU) or gelu_tanh (GEGLU), by `expf.gated`."""
    y = np.empty((gu.shape[0], gu.shape[1] // 2), np.float32)
    if gu.shape[0]:
        _gated_mul(gu, y, mode)
    return y


def gated_mul(gu: torch.Tensor, mode: int = SWIGLU) -> torch.Tensor:
    return torch.from_numpy(gated_mul_np(gu.contiguous().numpy(), mode))


def silu_mul_np(gu: np.ndarray) -> np.ndarray:
    return gated_mul_np(gu, SWIGLU)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    return gated_mul(gu, SWIGLU)


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def gelu_mul(gu: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gate_up (M, 2I) -> gelu_tanh(gate) * up (M, I)."""
    return gated_mul(gu, GEGLU)


def gelu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return gelu32_ref(g) * u


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


@njit(cache=True, nogil=True)
def qkv_rope_cache_into(qkv, Hq, Hkv, D, q_norm, k_norm, eps, cos, sin, table, slot, pos, kt, v, q_out):
    tmp = np.empty(D, np.float32)
    kr = np.empty(D, np.float32)
    for r in range(qkv.shape[0]):
        p = pos[r]
        B = kt.shape[3]
        blk = table[slot[r], p // B]
        off = p % B
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
                kt[g, blk, d, off] = kv_store(kr[d], kt)
                v[g, blk, off, d] = kv_store(row[(Hq + Hkv + g) * D + d], v)
    return q_out


def qkv_rope_cache(qkv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, q_norm: np.ndarray,
                   k_norm: np.ndarray, eps: float, cos: torch.Tensor, sin: torch.Tensor, table: np.ndarray,
                   slot: torch.Tensor, pos: torch.Tensor, kt: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """qkv (R, (Hq + 2 Hkv) D) -> rotated q (R, Hq, D); writes rotated k and v into the paged cache,
    kt (Hkv, P, D, B) and v (Hkv, P, B, D) (float32, or bfloat16: each entry rounded once), at position
    pos of slot's blocks (table (S, NB) int32, the blocks allocated). q_norm / k_norm: (D,) weights or empty arrays."""
    q = torch.empty(qkv.shape[0], n_heads, head_dim)
    if qkv.shape[0]:
        qkv_rope_cache_into(qkv.contiguous().numpy(), n_heads, n_kv, head_dim, q_norm, k_norm, np.float32(eps),
                        cos.numpy(), sin.numpy(), table, slot.numpy(), pos.numpy(), as_numpy(kt), as_numpy(v), q.numpy())
    return q


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


@njit(parallel=True, cache=True, nogil=True)
def _softmax(x, y):
    for m in prange(x.shape[0]):
        mx = _row_max(x[m])
        s = np.float32(0.0)
        for i in range(x.shape[1]):
            e = exp32(x[m, i] - mx)  # exp(-inf) = 0 for filtered tokens
            y[m, i] = e
            s += e
        for i in range(x.shape[1]):
            y[m, i] = y[m, i] / s
    return y


@njit(parallel=True, cache=True, nogil=True)
def _log_softmax(x, y):
    for m in prange(x.shape[0]):
        mx = _row_max(x[m])
        s = np.float32(0.0)
        for i in range(x.shape[1]):
            s += exp32(x[m, i] - mx)
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


@njit(cache=True, nogil=True)
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

@njit(cache=True, nogil=True)
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


def rope_table(inv_freq: "np.ndarray | torch.Tensor", n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_freq (D/2,) float32 (an array, or a CPU tensor) -> cos, sin (n_pos, D) float32 (halves repeated, HF
    layout)."""
    f = np.ascontiguousarray(np.asarray(inv_freq, np.float32))
    d = 2 * f.shape[0]
    cos = torch.empty(n_pos, d)
    sin = torch.empty(n_pos, d)
    _rope_table(f, n_pos, cos.numpy(), sin.numpy())
    return cos, sin
