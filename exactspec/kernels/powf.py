"""x ** y of float32s for RoPE's inverse frequencies (theta ** (2i / d)), our own: the same bits on every CPU.

torch computed them until now (`theta ** exponents` on a float32 tensor), and torch's float32 pow is not one
function: its vector body calls SLEEF's powf_u10 and its scalar tail calls libm's powf, and which elements fall
in the tail depends on torch's CPU capability (AVX2: 16 a step, AVX-512: 32, none without AVX2). They differ
in the last bit for some (theta, d): measured with torch 2.13 under ATEN_CPU_CAPABILITY=default/avx2/avx512,
theta 1e6 at d = 128 and 256 (Qwen3, Gemma 3) give other bits on a CPU without AVX2 than on one with it, and
theta 1e4 at d = 48 other bits on AVX2 than on AVX-512. Every model this project supports has d a power of
two >= 64, where AVX2 and AVX-512 both run the vector body on every element, so the bits written into
golden records and receipts are SLEEF's. This is that algorithm (SLEEF 3.x `xpowf`, as compiled with FMA:
exp(y log x) in float-float arithmetic, every operation one correctly rounded IEEE float32 op or an fma), so
those bits hold on any CPU, and without torch:

    log x:  x = 2^e m, m in [0.75, 1.5);  r = (m - 1) / (m + 1) in float-float;  log x = e ln2 + 2r + r^3 P(r^2)
    exp z:  z = y log x (float-float);  q = rint(z / ln 2);  s = z - q ln2 (two steps);  e^s by a degree-5
            polynomial, 1 + s + s^2 u in float-float;  times 2^q

Only the path RoPE takes is here: x finite and > 0, y finite (`pow_rope` checks); y == 0 or x == 1 gives 1.
The twin is torch's pow itself (tests/kernels/test_powf.py compares every element it runs through SLEEF).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .expf import _as_f32, _as_u32, fma32

_F = np.float32
ONE, TWO = _F(1.0), _F(2.0)
LN2_HI, LN2_LO = _F(0.69314718246459960938), _F(-1.904654323148236017e-09)  # ln 2 as a float-float
L2U, L2L = _F(0.693145751953125), _F(1.428606765330187045e-06)  # ln 2 in two parts for the reduction
R_LN2 = _F(1.442695040888963407359924681001892137426645954152985934135449406931)
LOG_P = (_F(0.240320354700088500976562), _F(0.285112679004669189453125), _F(0.400007992982864379882812))
LOG_C = (_F(0.66666662693023681640625), _F(3.69183861259614332084311e-09))  # 2/3 as a float-float
EXP_P = (_F(0.00136324646882712841033936), _F(0.00836596917361021041870117), _F(0.0416710823774337768554688),
         _F(0.166665524244308471679688), _F(0.499999850988388061523438))


# float-float helpers: (hi, lo) pairs; fms(a, b, c) = a * b - c and fnma(a, b, c) = c - a * b, each rounded once
@njit(inline="always")
def _fms(a, b, c):
    return fma32(a, b, -c)


@njit(inline="always")
def _fnma(a, b, c):
    return fma32(-a, b, c)


@njit(inline="always")
def _add2_ff(x, y):  # float + float, exact: the sum and its error
    r = x + y
    v = r - x
    return r, (x - (r - v)) + (y - v)


@njit(inline="always")
def _add2_f2f(xh, xl, y):  # float-float + float, any magnitudes
    r = xh + y
    v = r - xh
    return r, ((xh - (r - v)) + (y - v)) + xl


@njit(inline="always")
def _add2_f2f2(xh, xl, yh, yl):  # float-float + float-float, any magnitudes
    r = xh + yh
    v = r - xh
    return r, ((xh - (r - v)) + (yh - v)) + (xl + yl)


@njit(inline="always")
def _add_f2f2(xh, xl, yh, yl):  # float-float + float-float, |x| >= |y|
    r = xh + yh
    return r, (((xh - r) + yh) + xl) + yl


@njit(inline="always")
def _add_ff2(x, yh, yl):  # float + float-float, |x| >= |y|
    r = x + yh
    return r, ((x - r) + yh) + yl


@njit(inline="always")
def _mul_f2f(xh, xl, y):
    r = xh * y
    return r, fma32(xl, y, _fms(xh, y, r))


@njit(inline="always")
def _mul_f2f2(xh, xl, yh, yl):
    r = xh * yh
    return r, fma32(xh, yl, fma32(xl, yh, _fms(xh, yh, r)))


@njit(inline="always")
def _sq_f2(xh, xl):
    r = xh * xh
    return r, fma32(xh + xh, xl, _fms(xh, xh, r))


@njit(inline="always")
def _div_f2f2(nh, nl, dh, dl):
    t = ONE / dh
    q = nh * t
    u = _fms(t, nh, q)
    e = _fnma(dl, t, _fnma(dh, t, ONE))
    return q, fma32(q, e, fma32(nl, t, u))


@njit(inline="always")
def _ldexp(x, q):
    """x * 2^q for an int32 q (SLEEF's vldexp: four steps of 2^m, then 2^q's rest)."""
    m = q >> np.int32(31)
    m = (((m + q) >> np.int32(6)) - m) << np.int32(4)
    q = q - (m << np.int32(2))
    m = m + np.int32(127)
    m = m if m > 0 else np.int32(0)
    m = m if m <= 255 else np.int32(255)
    u = _as_f32(np.uint32(m << np.int32(23)))
    x = x * u * u * u * u
    return x * _as_f32(np.uint32((q + np.int32(127)) << np.int32(23)))


@njit(inline="always")
def _log2f(d):
    """log d as a float-float, d normal and > 0."""
    e = np.int32((_as_u32(d * (ONE / _F(0.75))) >> np.uint32(23)) & np.uint32(0xFF)) - np.int32(127)
    m = _as_f32(np.uint32(np.int32(_as_u32(d)) + (-e << np.int32(23))))
    nh, nl = _add2_ff(-ONE, m)
    dh, dl = _add2_ff(ONE, m)
    xh, xl = _div_f2f2(nh, nl, dh, dl)
    x2h, x2l = _sq_f2(xh, xl)
    t = fma32(fma32(LOG_P[0], x2h, LOG_P[1]), x2h, LOG_P[2])
    sh, sl = _mul_f2f(LN2_HI, LN2_LO, _F(e))
    sh, sl = _add_f2f2(sh, sl, xh * TWO, xl * TWO)
    ph, pl = _mul_f2f2(x2h, x2l, xh, xl)
    th, tl = _mul_f2f(x2h, x2l, t)
    th, tl = _add2_f2f2(th, tl, LOG_C[0], LOG_C[1])
    ph, pl = _mul_f2f2(ph, pl, th, tl)
    return _add_f2f2(sh, sl, ph, pl)


@njit(inline="always")
def _expf2(dh, dl):
    """e ** (dh + dl) as a float32."""
    q = np.int32(np.rint((dh + dl) * R_LN2))  # to nearest, ties to even
    sh, sl = _add2_f2f(dh, dl, _F(q) * -L2U)
    sh, sl = _add2_f2f(sh, sl, _F(q) * -L2L)
    h = sh + sl
    sh, sl = h, (sh - h) + sl
    u = fma32(fma32(fma32(fma32(EXP_P[0], sh, EXP_P[1]), sh, EXP_P[2]), sh, EXP_P[3]), sh, EXP_P[4])
    qh, ql = _sq_f2(sh, sl)
    th, tl = _mul_f2f(qh, ql, u)
    th, tl = _add_f2f2(sh, sl, th, tl)
    th, tl = _add_ff2(ONE, th, tl)
    r = _ldexp(th + tl, q)
    return _F(0.0) if dh < _F(-104.0) else r


@njit(inline="always")
def powf(x, y):
    """x ** y, x finite and > 0 (normal), y finite: SLEEF's float32 pow, bit for bit."""
    if y == _F(0.0) or x == ONE:
        return ONE
    lh, ll = _log2f(x)
    zh, zl = _mul_f2f(lh, ll, y)
    r = _expf2(zh, zl)
    return _F(np.inf) if np.isnan(r) else r


@njit(cache=True)
def _pow_rows(x, ys):
    out = np.empty(ys.shape[0], np.float32)
    for i in range(ys.shape[0]):
        out[i] = powf(x, ys[i])
    return out


def pow_rope(base: float, exponents: np.ndarray) -> np.ndarray:
    """float32(base) ** exponents (float32), element by element: RoPE's theta ** (2i / d)."""
    b = np.float32(base)
    if not (np.isfinite(b) and b >= np.finfo(np.float32).tiny):
        raise ValueError(f"RoPE theta {base!r}: must be a finite number > 0")
    e = np.ascontiguousarray(exponents, np.float32)
    if not np.isfinite(e).all():
        raise ValueError("RoPE exponents must be finite")
    return _pow_rows(b, e)
