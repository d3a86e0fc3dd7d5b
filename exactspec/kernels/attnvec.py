"""The attention's two inner loops as vector code (LLVM IR), for caches in blocks of 16 positions.

`score_blocks`: the scores of 16 keys per block, lane j = key j of the block: for d ascending,
s = s + q[d] * k[d, j] from +0.0 (a rounded product, then a rounded add: `attention._attend`'s scalar
loop, lane by lane). `add_values`: o[d] = o[d] + e[j] * v[j, d] for keys j ascending, lane = d.
Each lane is one output's chain; up to G chains (blocks, or chunks of 16 of d) run side by side only so
their adds' latencies overlap. Where fewer than G are left, the extra chains repeat the last one and
store the same bits to the same place. So no value depends on the vector width, the chunking or how
many chains run, and these give the bits of the scalar loops (tests/kernels/test_kernels.py).
Written in IR because numba cannot keep an accumulator of 16 lanes in a register across the loop
over d (it reloads and stores the scores, whose memory may alias the keys'): 3-4x slower.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

V = 16  # lanes: a block's keys (BLOCK), or a chunk of d
G = 4  # chains side by side

_F32 = ir.FloatType()
_I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
_VF = ir.VectorType(_F32, V)


def _c(v: int):
    return ir.Constant(_I64, v)


def _array(context, builder, ty, val):
    a = context.make_array(ty)(context, builder, val)
    return a, cgutils.unpack_tuple(builder, a.shape, ty.ndim), cgutils.unpack_tuple(builder, a.strides, ty.ndim)


def _at(builder, ptr, nbytes):
    """ptr (any pointer) + nbytes, as i8*."""
    return builder.gep(builder.bitcast(ptr, ir.IntType(8).as_pointer()), [nbytes])


def _load16(builder, p, bf16: bool):
    """16 stored entries at byte pointer p as float32 lanes (bfloat16 bits: shifted into the top half, exact)."""
    if not bf16:
        return builder.load(builder.bitcast(p, _VF.as_pointer()), align=4)
    h = builder.load(builder.bitcast(p, ir.VectorType(_I16, V).as_pointer()), align=2)
    w = builder.shl(builder.zext(h, ir.VectorType(_I32, V)), ir.Constant(ir.VectorType(_I32, V), [16] * V))
    return builder.bitcast(w, _VF)


def _splat(builder, x):
    e = builder.insert_element(ir.Constant(_VF, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(e, ir.Constant(_VF, ir.Undefined), ir.Constant(ir.VectorType(_I32, V), [0] * V))


def _block(builder, ba, bstr, i):
    """blocks[i] (int32) as i64."""
    return builder.sext(builder.load(builder.bitcast(_at(builder, ba.data, builder.mul(i, bstr)), _I32.as_pointer())), _I64)


def kv_vector_ok(kk) -> bool:
    """Can these loops read this cache array (numba type)?"""
    return isinstance(kk, types.Array) and kk.ndim == 3 and kk.layout == "C" and kk.dtype in (types.float32, types.uint16)


@intrinsic
def score_blocks(typingctx, q, kk, blocks, b0, nb, out):
    """out[16 i + j] = the score of key j of block blocks[b0 + i], i < min(nb, G) (nb >= 1): q (D,) float32,
    kk (P, D, 16) float32 or uint16 (bfloat16 bits) C-contiguous, blocks (NB,) int32, out float32."""
    if not kv_vector_ok(kk):
        return None
    sig = types.void(q, kk, blocks, b0, nb, out)
    bf16 = kk.dtype == types.uint16

    def codegen(context, builder, signature, args):
        qv, kv, bv, b0v, nbv, ov = args
        qa, (D,), (qs,) = _array(context, builder, signature.args[0], qv)
        ka, _, (ks0, ks1, _) = _array(context, builder, signature.args[1], kv)
        ba, _, (bs,) = _array(context, builder, signature.args[2], bv)
        oa, _, (os_,) = _array(context, builder, signature.args[5], ov)
        last = builder.sub(nbv, _c(1))
        slots = [builder.select(builder.icmp_signed("<", _c(i), nbv), _c(i), last) for i in range(G)]
        kp = [_at(builder, ka.data, builder.mul(_block(builder, ba, bs, builder.add(b0v, s)), ks0)) for s in slots]
        acc = [cgutils.alloca_once_value(builder, ir.Constant(_VF, None)) for _ in range(G)]
        with cgutils.for_range(builder, D) as loop:
            d = loop.index
            qd = _splat(builder, builder.load(builder.bitcast(_at(builder, qa.data, builder.mul(d, qs)), _F32.as_pointer())))
            for i in range(G):
                k = _load16(builder, builder.gep(kp[i], [builder.mul(d, ks1)]), bf16)
                builder.store(builder.fadd(builder.load(acc[i]), builder.fmul(qd, k)), acc[i])
        for i in range(G):
            p = _at(builder, oa.data, builder.mul(builder.mul(slots[i], _c(V)), os_))
            builder.store(builder.load(acc[i]), builder.bitcast(p, _VF.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def add_values(typingctx, o, e, vv, blocks, j0, j1):
    """o[d] = o[d] + e[j - j0] * (value d of key j) for keys j = j0 .. j1 - 1 ascending (key j: row j % 16 of
    block blocks[j // 16] of vv (P, 16, D) float32 or uint16, C-contiguous); o (D,) float32, D a multiple of 16."""
    if not kv_vector_ok(vv):
        return None
    sig = types.void(o, e, vv, blocks, j0, j1)
    bf16 = vv.dtype == types.uint16
    size = 2 if bf16 else 4

    def codegen(context, builder, signature, args):
        ov, ev, vv_, bv, j0v, j1v = args
        oa, (D,), (os_,) = _array(context, builder, signature.args[0], ov)
        ea, _, (es,) = _array(context, builder, signature.args[1], ev)
        va, _, (vs0, vs1, _) = _array(context, builder, signature.args[2], vv_)
        ba, _, (bs,) = _array(context, builder, signature.args[3], bv)
        chunks = builder.udiv(D, _c(V))
        with cgutils.for_range_slice(builder, _c(0), chunks, _c(G)) as (c0, _):
            last = builder.sub(chunks, _c(1))
            cs = [builder.select(builder.icmp_signed("<", builder.add(c0, _c(i)), chunks), builder.add(c0, _c(i)), last)
                  for i in range(G)]
            op = [builder.bitcast(_at(builder, oa.data, builder.mul(builder.mul(c, _c(V)), os_)), _VF.as_pointer())
                  for c in cs]
            acc = [cgutils.alloca_once(builder, _VF) for _ in range(G)]
            for a, p in zip(acc, op):
                builder.store(builder.load(p, align=4), a)
            with cgutils.for_range_slice(builder, j0v, j1v, _c(1)) as (j, _):
                row = _at(builder, va.data, builder.add(builder.mul(_block(builder, ba, bs, builder.sdiv(j, _c(V))), vs0),
                                                        builder.mul(builder.srem(j, _c(V)), vs1)))
                w = builder.load(builder.bitcast(_at(builder, ea.data, builder.mul(builder.sub(j, j0v), es)), _F32.as_pointer()))
                ws = _splat(builder, w)
                for a, c in zip(acc, cs):
                    v = _load16(builder, builder.gep(row, [builder.mul(c, _c(V * size))]), bf16)
                    builder.store(builder.fadd(builder.load(a), builder.fmul(ws, v)), a)
            for a, p in zip(acc, op):
                builder.store(builder.load(a), p, align=4)
        return context.get_dummy_value()
    return sig, codegen
