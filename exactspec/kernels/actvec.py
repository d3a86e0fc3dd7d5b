"""The activation quantizer's group loop as vector code (LLVM IR): `quantize_groups(x, q, d, s)` does for
every group of 32 values of the row x what actquant._quantize_row does, with the same operations:
    amax = max |x[k]| (exact in any order: |x| compared as the integers of its bits, which order non-NaN
    floats as their values), bad = a NaN or an infinity in the group (those bits above the largest
    finite float's);
    d = amax / 127 (one float32 division); q[k] = rint(x[k] / d) clamped to [-127, 127] (each lane one
    correctly rounded division, then round-half-to-even), 0 where d is 0 or the group is bad;
    s = sum q[k] (int32, exact); d = NaN where bad.
Why: numba keeps the scalar loop's max and its branches scalar (no reassociation without fastmath), ~2.5
ns a value; a 5-row verify quantizes ~0.5 M values. Tests: tests/kernels/test_int_dot.py.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .quant import QK

_F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)


def _vec(t):
    return ir.VectorType(t, QK)


def _splat(t, v):
    return ir.Constant(_vec(t), [v] * QK)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _types_ok(x, q, d, s) -> bool:
    """Can quantize_groups take these numba array types (1-D; run time: unit strides, checked by the caller)?"""
    return all(isinstance(a, types.Array) and a.ndim == 1 for a in (x, q, d, s)) and (
        x.dtype, q.dtype, d.dtype, s.dtype) == (types.float32, types.int8, types.float32, types.int32)


@intrinsic
def quantize_groups(typingctx, x, q, d, s):
    """x (K,) float32 -> q (K,) int8, d (K/32,) float32, s (K/32,) int32, each with unit strides."""
    if not _types_ok(x, q, d, s):
        return None
    sig = types.void(x, q, d, s)

    def codegen(context, builder, signature, args):
        xa, qa, da, sa = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args))
        (K,) = cgutils.unpack_tuple(builder, xa.shape, 1)
        vf, vi = _vec(_F32), _vec(_I32)
        umax = _fn(builder, "llvm.vector.reduce.umax.v32i32", _I32, [vi])
        add = _fn(builder, "llvm.vector.reduce.add.v32i32", _I32, [vi])
        rint = _fn(builder, "llvm.rint.v32f32", vf, [vf])
        with cgutils.for_range(builder, builder.udiv(K, ir.Constant(_I64, QK))) as loop:
            g = loop.index
            k0 = builder.mul(g, ir.Constant(_I64, QK))
            xv = builder.load(builder.bitcast(builder.gep(xa.data, [k0]), vf.as_pointer()), align=4)
            mag = builder.and_(builder.bitcast(xv, vi), _splat(_I32, 0x7FFFFFFF))
            top = builder.call(umax, [mag])
            bad = builder.icmp_unsigned(">", top, ir.Constant(_I32, 0x7F7FFFFF))
            dv = builder.fdiv(builder.bitcast(top, _F32), ir.Constant(_F32, 127.0))
            ok = builder.and_(builder.fcmp_ordered(">", dv, ir.Constant(_F32, 0.0)), builder.not_(bad))
            e = builder.insert_element(ir.Constant(vf, ir.Undefined), dv, ir.Constant(_I32, 0))
            dvv = builder.shuffle_vector(e, ir.Constant(vf, ir.Undefined), ir.Constant(vi, [0] * QK))
            r = builder.call(rint, [builder.fdiv(xv, dvv)])
            lo, hi = _splat(_F32, -127.0), _splat(_F32, 127.0)
            r = builder.select(builder.fcmp_ordered(">", r, lo), r, lo)  # max(r, -127), then min(., 127)
            r = builder.select(builder.fcmp_ordered("<", r, hi), r, hi)
            qi = builder.select(ok, builder.fptosi(r, vi), ir.Constant(vi, None))
            builder.store(builder.trunc(qi, _vec(_I8)), builder.bitcast(builder.gep(qa.data, [k0]), _vec(_I8).as_pointer()),
                          align=1)
            builder.store(builder.call(add, [qi]), builder.gep(sa.data, [g]))
            builder.store(builder.select(bad, ir.Constant(_F32, float("nan")), dv), builder.gep(da.data, [g]))
        return context.get_dummy_value()
    return sig, codegen
