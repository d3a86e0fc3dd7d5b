"""The register tile of the linear kernel, written in LLVM IR (numba intrinsics).

Contract: `run_tile(mr, x, m0, w, b, t)` computes, for rows m0 .. m0+mr-1 of x (M, K) float32 and
the NL = 32 output lanes of packed weight block b of w,
t[r, j] = fma(x[m0+r, K-1], w[b, K-1, j], ... fma(x[m0+r, 0], w[b, 0, j], +0.0)): each output is one
chain of fused multiply-adds over k = 0, 1, ..., K-1, nothing else. The weight formats (each block's
data contiguous, the blocks at any stride):
* float32 (nblk, K, NL), or uint16 (nblk, K, NL) holding bfloat16 bits (widened exactly: the top half
  of a float32);
* quantized, in groups of QK = 32 k's: per block and group, the quants (k-major, lane-minor), then
  the lanes' float16 scales (and, Q4_1 and Q4_K, minimums; Q4_K, its 6-bit group scales and
  minimums; Q6_K, an int8 scale per 16 k's): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (layout.py). The weight the chain multiplies is the format's
  dequantized value, computed in registers with one fixed expression (layout.Format's docstring);
  each is the gguf package's dequantization to the bit, so a quantized tile computes the same chains as the
  float32 tile on the dequantized weights.

Why this is exact on any x86-64 CPU, for any tile shape:
* `llvm.fma` is one correctly rounded IEEE operation: the same bits whether the CPU has an FMA
  unit or LLVM calls libm's fmaf.
* The lanes of a vector are different outputs; a <16 x float> is split into 2 AVX2 registers, 1
  AVX-512 register or 4 SSE registers without changing any lane's arithmetic. No reduction ever
  runs across lanes, so the vector width never enters the result.
* A row's chain does not depend on the other rows of the tile (they only share the weight
  loads), so mr = 1 and mr = 10 give the same bits for the same row; the tile height is a speed
  choice (`MR_MAX`, by the registers the target has) and never a numerical one.
* The accumulators are SSA values (phi nodes), so they live in registers across the k loop and
  each weight vector is loaded and widened once per tile.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .cpu import HALF_TILES, MR_HALF, MR_INT, MR_MAX
from .ftile import V, FTile
from .itile import ITile
from .layout import LAYOUTS, NL


def _format_of(dtype) -> str:
    if isinstance(dtype, types.Record):
        (name,) = dtype.fields
        return name
    return {types.float32: "f32", types.uint16: "bf16", types.uint8: "q8_0"}[dtype]


def halved(fmt: str) -> bool:
    """Whether weights of layout fmt run in half tiles of 2 to MR_HALF rows (cpu.HALF_TILES: the integer dots of
    AVX2 and AVX-VNNI; one row keeps the whole tile)."""
    return HALF_TILES and fmt in LAYOUTS and LAYOUTS[fmt].int_dot


def _trap(builder) -> None:
    cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.trap")
    builder.call(builder.module.get_global("llvm.trap"), [])


def _make(mr: int, v: int | None = None):
    """The tile of mr rows; v: the half tile of output vector v (lanes V v .. V v + V - 1) alone."""
    @intrinsic
    def tile(typingctx, x, m0, w, b, t):
        fmt = _format_of(w.dtype)
        int_dot = fmt in LAYOUTS and LAYOUTS[fmt].int_dot
        if int_dot != isinstance(x, types.BaseTuple):
            raise TypeError(f"tile: {fmt} weights take {'(q, d, s) int8 activations' if int_dot else 'float rows'}")

        def codegen(context, builder, signature, args):
            half = halved(fmt)
            most = MR_HALF if v is not None else 1 if half else MR_INT if int_dot else MR_MAX
            if (v is not None and not half) or mr > most:
                _trap(builder)  # never called (linear_block's tiles are at most this tall, halves where halved): no code
            elif int_dot:
                ITile(context, builder, signature, args, mr, fmt, *(() if v is None else ((v,),))).build()
            else:
                FTile(context, builder, signature, args, mr, fmt).build()
            return context.get_dummy_value()
        return types.void(x, m0, w, b, t), codegen
    return tile


_t = [_make(mr) for mr in range(1, 11)]
_t1, _t2, _t3, _t4, _t5, _t6, _t7, _t8, _t9, _t10 = _t
_h = [[_make(mr, v) for mr in range(2, MR_HALF + 1)] for v in range(NL // V)]
_h02, _h03, _h04 = _h[0]
_h12, _h13, _h14 = _h[1]


def _halved(w):
    """halved(w's layout), as a compile-time constant (compiled code only)."""


@overload(_halved)
def _halved_impl(w):
    h = halved(_format_of(w.dtype))
    return lambda w: h


@njit(inline="always")
def _run_half(mr, x, m0, w, b, t):
    # output vector 0's tile, then vector 1's: t[:mr, :16] and t[:mr, 16:]
    if mr == 2:
        _h02(x, m0, w, b, t)
        _h12(x, m0, w, b, t)
    elif mr == 3:
        _h03(x, m0, w, b, t)
        _h13(x, m0, w, b, t)
    else:
        _h04(x, m0, w, b, t)
        _h14(x, m0, w, b, t)


@njit(inline="always")
def run_tile(mr, x, m0, w, b, t):
    """t[:mr, :NL] = the FMA chains of rows m0..m0+mr-1 against block b (K >= 1, mr <= MR_MAX); for an
    integer-dot layout, x is actquant's (q, d, s) and t the combine of itile.py (mr <= MR_INT, or MR_HALF for
    `halved` layouts; t has 2 mr rows: the AVX2 tile keeps integer sums in the second mr, linear.BUF_ROWS)."""
    if _halved(w) and mr > 1:
        _run_half(mr, x, m0, w, b, t)
    elif mr == 1:
        _t1(x, m0, w, b, t)
    elif mr == 2:
        _t2(x, m0, w, b, t)
    elif mr == 3:
        _t3(x, m0, w, b, t)
    elif mr == 4:
        _t4(x, m0, w, b, t)
    elif mr == 5:
        _t5(x, m0, w, b, t)
    elif mr == 6:
        _t6(x, m0, w, b, t)
    elif mr == 7:
        _t7(x, m0, w, b, t)
    elif mr == 8:
        _t8(x, m0, w, b, t)
    elif mr == 9:
        _t9(x, m0, w, b, t)
    else:
        _t10(x, m0, w, b, t)
