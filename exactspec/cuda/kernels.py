"""Batch-invariant Triton kernels for CUDA, each beside its plain torch twin (`*_ref`, float64).

The rule is the CPU kernels' (exactspec/kernels/__init__.py): every reduction's order and grouping are
fixed by the weight shape (or the head size) alone, never by the number of rows in a call, the batch,
or the cache length. So:
* `matmul`: one tile configuration per weight shape (`matmul_config(N, K)`), never chosen by M; no
  split-K; the K loop runs from 0 in steps of BK; rows past M are masked. An output element is its own
  sum, whatever tile row it sits in and whatever the other rows hold.
* `rmsnorm`, `softmax`, `log_softmax`: one program per row, the row read in fixed blocks from index 0
  into a vector accumulator, reduced once at the end.
* `attention`: one program per (query row, head). A row scores its allowed keys from the first
  allowed one (its sequence's position 0 for causal rows, wherever padding put it; the window's start for
  sliding rows), in blocks of BN, with an online softmax in that order; so prefill, decode and verify
  rows give the same bits, alone or beside any others, over a cache of any length.
Elementwise functions (exp, rsqrt) are per element on a GPU: no vector-body / scalar-tail split.

Under TRITON_INTERPRET=1 (the CPU tests) every kernel runs in numpy. Triton 3.9's interpreter runs
`tl.dot` as `np.matmul`, i.e. the BLAS numpy was built with (OpenBLAS), whose float32 kernel picks its
code path by a row's place in the tile on some CPUs (OpenBLAS's Haswell kernel, the one AVX2-only CPUs
get: a row alone at tile row 0 and the same row at tile row 6 round differently), and it multiplies
bfloat16 operands as their raw uint16 bits. So there the matmul tile is an explicit sum over k of
float32 products (`UNFUSED`: numpy adds the k slices in order, the same for every row); a GPU runs
`tl.dot`. The interpreter also rounds float32 to bfloat16 by truncation where a GPU rounds to nearest
even: there a bfloat16 result's last bit can differ from a GPU's, alike for every row. Everything else
is the code a GPU compiles.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NO_FUSION = dict(enable_fp_fusion=False)  # a multiply and an add stay two roundings, as the source says
ROW_WARPS = ATTN_WARPS = 4


# --- matmul: y (M, N) = x (M, K) @ w (N, K)^T (+ bias), float32 accumulation -------------------------

def matmul_config(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for a weight of shape (n, k): a function of the shape only."""
    bn = 32 if n <= 8192 else 64  # narrow tiles keep every SM busy on a decode row
    bk = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    return 32, bn, bk, 4, 3


@triton.jit
def _matmul_kernel(x, w, b, y, M, N, K, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, UNFUSED: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        bt = tl.load(w + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if UNFUSED:  # the interpreter: an explicit k-ordered sum (its tl.dot is BLAS, see matmul)
            acc += tl.sum(a.to(tl.float32)[:, :, None] * bt.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(a, bt, acc, input_precision="ieee")  # float32 weights: no TF32, as torch's default
        else:
            acc = tl.dot(a, bt, acc)
    if HAS_BIAS:
        acc += tl.load(b + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(y + rm[:, None] * N + rn[None, :], acc.to(y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (M, K), w (N, K) of x's dtype, bias (N,) float32 or None -> (M, N) in out_dtype (default x's)."""
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    bm, bn, bk, warps, stages = matmul_config(N, K)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _matmul_kernel[grid](x, w, bias if bias is not None else w, y, M, N, K, HAS_BIAS=bias is not None,
                         BM=bm, BN=bn, BK=bk, UNFUSED=INTERPRETED,
                         IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages, **NO_FUSION)
    return y


def matmul_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + bias.double() if bias is not None else y


# --- row kernels: rmsnorm, silu * up, softmax, log-softmax -----------------------------------------------

def _row_block(k: int) -> int:
    return min(triton.next_power_of_2(max(k, 16)), 4096)


@triton.jit
def _rmsnorm_kernel(x, y, K, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        c = k0 + tl.arange(0, BLOCK)
        v = tl.load(x + row * K + c, mask=c < K, other=0.0).to(tl.float32)
        acc += v * v
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / K + eps)
    for k0 in range(0, K, BLOCK):
        c = k0 + tl.arange(0, BLOCK)
        v = tl.load(x + row * K + c, mask=c < K, other=0.0).to(tl.float32)
        tl.store(y + row * K + c, (v * inv).to(y.dtype.element_ty), mask=c < K)


def rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x (M, K) -> x * rsqrt(mean(x^2) + eps) per row, computed in float32, returned in x's dtype
    (transformers' RMSNorm before its weight multiply)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _rmsnorm_kernel[(x.shape[0],)](x, y, x.shape[1], float(eps), BLOCK=_row_block(x.shape[1]), num_warps=ROW_WARPS,
                                       **NO_FUSION)
    return y


def rmsnorm_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@triton.jit
def _silu_mul_kernel(gu, y, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(gu + row * 2 * I + c, mask=c < I, other=0.0).to(tl.float32)
    u = tl.load(gu + row * 2 * I + I + c, mask=c < I, other=0.0).to(tl.float32)
    tl.store(y + row * I + c, (g / (1.0 + tl.exp(-g)) * u).to(y.dtype.element_ty), mask=c < I)


SILU_BLOCK = 1024


def silu_mul(gu: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """gu (M, 2I): gate then up -> silu(gate) * up (M, I) in out_dtype, elementwise in float32."""
    gu = gu.contiguous()
    M, I2 = gu.shape
    y = torch.empty(M, I2 // 2, dtype=out_dtype, device=gu.device)
    if y.numel():
        _silu_mul_kernel[(M, triton.cdiv(I2 // 2, SILU_BLOCK))](gu, y, I2 // 2, BLOCK=SILU_BLOCK, num_warps=ROW_WARPS,
                                                                **NO_FUSION)
    return y


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.double().chunk(2, -1)
    return torch.nn.functional.silu(g) * u


@triton.jit
def _softmax_kernel(x, y, K, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    mx = tl.full((BLOCK,), float("-inf"), tl.float32)
    for k0 in range(0, K, BLOCK):
        c = k0 + tl.arange(0, BLOCK)
        mx = tl.maximum(mx, tl.load(x + row * K + c, mask=c < K, other=float("-inf")).to(tl.float32))
    m = tl.max(mx, axis=0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        c = k0 + tl.arange(0, BLOCK)
        acc += tl.exp(tl.load(x + row * K + c, mask=c < K, other=float("-inf")).to(tl.float32) - m)
    s = tl.sum(acc, axis=0)
    for k0 in range(0, K, BLOCK):
        c = k0 + tl.arange(0, BLOCK)
        v = tl.load(x + row * K + c, mask=c < K, other=0.0).to(tl.float32) - m
        out = v - tl.log(s) if LOG else tl.exp(v) / s
        tl.store(y + row * K + c, out, mask=c < K)


def _softmax(x: torch.Tensor, log: bool) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(-1, shape[-1]).contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        _softmax_kernel[(x.shape[0],)](x, y, x.shape[1], LOG=log, BLOCK=_row_block(x.shape[1]), num_warps=ROW_WARPS,
                                       **NO_FUSION)
    return y.view(shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, float32 out."""
    return _softmax(x, False)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dimension, float32 out."""
    return _softmax(x, True)


# --- attention ---------------------------------------------------------------------------------------

@triton.jit
def _attention_kernel(q, k, v, mask, lohi, o, T, S, Hq, HKV, D, scale, MASK_B: tl.constexpr,
                      BN: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    g = h // (Hq // HKV)
    rd = tl.arange(0, BD)
    qrow = tl.load(q + ((b * Hq + h) * T + t).to(tl.int64) * D + rd, mask=rd < D, other=0.0).to(tl.float32)
    lo = tl.load(lohi + (b * T + t) * 2)
    hi = tl.load(lohi + (b * T + t) * 2 + 1)  # one past the last allowed key; lo == hi: none
    kv = k + ((b * HKV + g) * S).to(tl.int64) * D
    vv = v + ((b * HKV + g) * S).to(tl.int64) * D
    mrow = mask + ((b if MASK_B else 0) * T + t).to(tl.int64) * S
    m_i = tl.max(tl.full((BN,), float("-inf"), tl.float32), axis=0)  # float32 scalars carried by the loop
    l_i = tl.sum(tl.zeros((BN,), tl.float32), axis=0)
    acc = tl.zeros((BD,), tl.float32)
    for s0 in range(lo, hi, BN):
        rs = s0 + tl.arange(0, BN)
        inside = rs < hi
        kb = tl.load(kv + rs[:, None] * D + rd[None, :], mask=inside[:, None] & (rd[None, :] < D), other=0.0)
        s = tl.sum(kb.to(tl.float32) * qrow[None, :], axis=1) * scale
        allowed = inside & (tl.load(mrow + rs, mask=inside, other=0) != 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m_i - m_safe)
        vb = tl.load(vv + rs[:, None] * D + rd[None, :], mask=inside[:, None] & (rd[None, :] < D), other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vb.to(tl.float32), axis=0)
        m_i = m_new
    out = tl.where(l_i > 0, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)  # a row that may attend nothing (a padding query): zeros
    tl.store(o + ((b * T + t) * Hq + h).to(tl.int64) * D + rd, out.to(o.dtype.element_ty), mask=rd < D)


ATTN_BN = 32


def attention_bounds(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask (B or 1, T, S) bool -> (the mask as uint8, (B or 1, T, 2) int32: each row's first allowed key
    and one past its last; 0, 0 where it allows none). One forward's layers share them (exactspec.hf)."""
    mask = mask.bool()
    S = mask.shape[-1]
    lohi = torch.zeros(*mask.shape[:2], 2, dtype=torch.int32, device=mask.device)
    any_ = mask.any(-1)
    idx = torch.arange(S, device=mask.device)
    lohi[..., 0] = torch.where(mask, idx, S).amin(-1).where(any_, 0).to(torch.int32)
    lohi[..., 1] = torch.where(mask, idx + 1, 0).amax(-1).where(any_, 0).to(torch.int32)
    return mask.to(torch.uint8).contiguous(), lohi


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """transformers' layout: q (B, Hq, T, D), k/v (B, Hkv, S, D), mask (B or 1, T, S) bool (True = attend)
    -> (B, T, Hq, D) in q's dtype. Row t attends the keys its mask row allows, scored from the first
    allowed key in blocks of ATTN_BN. bounds: `attention_bounds(mask)`, if the caller has them."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    mask, lohi = bounds if bounds is not None else attention_bounds(mask)
    if mask.shape[0] != B:
        lohi = lohi.expand(B, T, 2)
    _attention_kernel[(T, B * Hq)](q.contiguous(), k.contiguous(), v.contiguous(), mask, lohi.contiguous(), out,
                                   T, S, Hq, Hkv, D, float(scale), MASK_B=mask.shape[0] != 1, BN=ATTN_BN,
                                   BD=triton.next_power_of_2(D), num_warps=ATTN_WARPS, **NO_FUSION)
    return out


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    grp = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(grp, 1), v.double().repeat_interleave(grp, 1)
    s = (q.double() @ k.transpose(2, 3)) * scale
    s = s.masked_fill(~mask.bool()[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows with no allowed key: zeros
    return (p @ v).transpose(1, 2)
