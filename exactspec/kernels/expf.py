"""exp of a float32, our own: the same bits for an element in a vector body or a scalar tail, on any CPU,
whatever libm the machine has (glibc picks its expf by CPU and has changed it between versions), and
vectorizable (a libm call in a loop is not: attention's softmax spent ~1/3 of its time there).

    n = rint(x * f32(log2 e)), kept in [-150, 128] (NaN -> -150: the result is NaN anyway)
    r = fma(n, -C1, x);  r = fma(n, C2, r)          C1 = 0.693359375 (10 bits: n * C1 is exact), C1 - C2 = ln 2
    p = 1/7!;  p = fma(p, r, 1/k!) for k = 6 .. 0     (Horner, the degree-7 Taylor polynomial, |r| <= 0.35)
    y = (p * 2^h) * 2^(n - h),  h = n >> 1            (both powers normal: the second product is the only
                                                        rounding where y is subnormal)
    x < -104: +0.0;  x > 88.72283 (exp overflows): +inf;  NaN: NaN
Each step is one correctly rounded IEEE operation (rint, fma, mul), so the bits are fixed by x alone.
Error: under 1 ulp (0.90 ulp measured over 2M points, tests/kernels/test_expf.py). `exp32_ref` is the
same sequence in torch (`fma_ref`).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_F = np.float32
LOG2E = _F(1.4426950408889634)
C1, C2 = _F(0.693359375), _F(2.12194440e-4)
COEFS = tuple(_F(1.0 / f) for f in (5040.0, 720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0))  # 1/7! .. 1/0!
LO, HI = _F(-104.0), _F(88.72283)
SHIFTER = _F(12582912.0)  # 1.5 * 2^23: adding it rounds to an integer (to nearest, ties to even)


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c rounded once (llvm.fma: an FMA instruction, or libm's fmaf: the same bits)."""
    if not all(t == types.float32 for t in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType()] * 3),
                                           "llvm.fma.f32")
        return builder.call(f, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _as_f32(typingctx, bits):
    """The float32 whose bits are the uint32 `bits`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _as_u32(typingctx, x):
    """The bits of the float32 x, as a uint32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@njit(inline="always")
def _pow2(e):
    """2^e as float32, e an int32 in [-126, 127]."""
    return _as_f32(np.uint32((e + np.int32(127)) << np.int32(23)))


@njit(inline="always")
def exp32(x):
    n = (x * LOG2E + SHIFTER) - SHIFTER  # rint (to nearest, ties to even) for |v| < 2^22; NaN stays NaN
    n = n if n >= _F(-150.0) else _F(-150.0)
    n = n if n <= _F(128.0) else _F(128.0)
    r = fma32(n, -C1, x)
    r = fma32(n, C2, r)
    p = COEFS[0]
    p = fma32(p, r, COEFS[1])
    p = fma32(p, r, COEFS[2])
    p = fma32(p, r, COEFS[3])
    p = fma32(p, r, COEFS[4])
    p = fma32(p, r, COEFS[5])
    p = fma32(p, r, COEFS[6])
    p = fma32(p, r, COEFS[7])
    ni = np.int32(n)
    h = ni >> np.int32(1)
    y = (p * _pow2(h)) * _pow2(ni - h)
    if x < LO:
        y = _F(0.0)
    if x > HI:
        y = _F(np.inf)
    return y


GELU_C = _F(0.044715)
GELU_K2 = _F(2.0 * math.sqrt(2.0 / math.pi))  # 2 sqrt(2/pi): 0.5 (1 + tanh(y)) = 1 / (1 + exp(-2y))


@njit(inline="always")
def gelu32(g):
    """GELU, tanh form (transformers' gelu_pytorch_tanh, llama.cpp's GELU), as g * sigmoid(2y),
    y = sqrt(2/pi) (g + 0.044715 g^3): g / (1 + exp32(-(K2 (g + C (g g g))))), plain mul/add and exp32,
    so the bits are fixed by g alone. |g| large: g or -0.0; NaN: NaN."""
    a = GELU_K2 * (g + GELU_C * (g * g * g))
    return g / (_F(1.0) + exp32(-a))


SWIGLU, GEGLU = 2, 3  # a gated MLP's activation (also kernels.linear's epilogue modes)


@njit(inline="always")
def gated(g, u, mode):
    """act(g) * u of a gated MLP: silu, g / (1 + exp32(-g)) (SWIGLU), or gelu32 (GEGLU: Gemma). The one
    expression of both, for linear_block's fused epilogue and rows.gated_mul alike."""
    if mode == GEGLU:
        return gelu32(g) * u
    return g / (_F(1.0) + exp32(-g)) * u


def gelu32_ref(g: torch.Tensor) -> torch.Tensor:
    """The torch twin of `gelu32`, bitwise."""
    g = g.float()
    a = torch.full_like(g, float(GELU_K2)) * (g + torch.full_like(g, float(GELU_C)) * (g * g * g))
    return g / (torch.ones_like(g) + exp32_ref(-a))


def _pow2_ref(e: torch.Tensor) -> torch.Tensor:
    return ((e + 127) << 23).view(torch.float32)


def exp32_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch twin of `exp32` (float32 in, float32 out), bitwise."""
    x = x.float()
    n = torch.round(x * float(LOG2E))  # half to even, as rint
    n = torch.where(n >= -150.0, n, torch.full_like(n, -150.0))
    n = torch.where(n <= 128.0, n, torch.full_like(n, 128.0))
    r = fma_ref(n, torch.full_like(x, float(-C1)), x)
    r = fma_ref(n, torch.full_like(x, float(C2)), r)
    p = torch.full_like(x, float(COEFS[0]))
    for c in COEFS[1:]:
        p = fma_ref(p, r, torch.full_like(x, float(c)))
    ni = n.to(torch.int32)
    h = torch.div(ni, 2, rounding_mode="floor")  # = ni >> 1
    y = (p * _pow2_ref(h)) * _pow2_ref(ni - h)
    y = torch.where(x < float(LO), torch.zeros_like(y), y)
    return torch.where(x > float(HI), torch.full_like(y, float("inf")), y)


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
