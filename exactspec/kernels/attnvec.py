"""The attention's two inner loops as vector code (LLVM IR), for caches in blocks of 16 positions.

`score_blocks`: the scores of 16 keys per block, lane j = key j of the block: for d ascending,
s = fma(q[d], k[d, j], s) from +0.0 (one correctly rounded FMA a step: `attention.attend_into`'s scalar
loop, lane by lane). `add_values`: o[d] = fma(e[j], v[j, d], o[d]) for keys j ascending, lane = d.
Each lane is one output's chain. Both take Q <= QMAX queries at once (the query heads of one KV head, and
rows of one sequence): each key block or value row is loaded once for all of them, and the query count
is a switch over code written for each Q. Up to G chains per query (blocks, or chunks of 16 of d) run
side by side only so their latencies overlap; where fewer are left, the extra chains repeat the last one
and store the same bits to the same place. So no value depends on the vector width, the chunking, the
query count or how many chains run, and these give the bits of the scalar loops
(tests/kernels/test_kernels.py). Written in IR because numba cannot keep an accumulator of 16 lanes in a
register across the loop over d (it reloads and stores the scores, whose memory may alias the keys'):
3-4x slower. Why FMA and shared loads (measured, bench/attention.py): on this Xeon a 9-row verify's
attention was bound by the multiplies and adds and by reading each key once per query head and row.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

V = 16  # lanes: a block's keys (BLOCK), or a chunk of d
G = 4  # chains side by side (at most)
QMAX = 8  # queries sharing each load of a key block or value row

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


def _fma(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")


def _per_q(builder, Q, body) -> None:
    """Emit body(n) for each query count n = 1..QMAX, chosen at run time by Q (i64); nothing for others."""
    end = builder.append_basic_block("q_end")
    sw = builder.switch(Q, end)
    for n in range(1, QMAX + 1):
        bb = builder.append_basic_block(f"q{n}")
        sw.add_case(_c(n), bb)
        builder.position_at_end(bb)
        body(n)
        builder.branch(end)
    builder.position_at_end(end)


def _chains(builder, i0, count, g: int) -> list:
    """The g chains from i0: i0 + i, or count - 1 where that is past the end (an extra chain repeats the last)."""
    last = builder.sub(count, _c(1))
    return [builder.select(builder.icmp_signed("<", builder.add(i0, _c(i)), count), builder.add(i0, _c(i)), last)
            for i in range(g)]


def score_chains(n: int) -> int:
    """Blocks side by side for n queries: n * blocks chains, at most G blocks (12 accumulators or fewer)."""
    return max(1, min(G, 12 // n))


def value_chains(n: int) -> int:
    """Chunks of 16 d's side by side for n queries."""
    return max(1, min(G, 16 // n))


@intrinsic
def score_blocks(typingctx, q, kk, blocks, b0, nb, out):
    """out[i, 16 b + j] = query i's score of key j of block blocks[b0 + b], for b < nb and queries i < Q <=
    QMAX: q (Q, D) float32 (rows contiguous), kk (P, D, 16) float32 or uint16 (bfloat16 bits)
    C-contiguous, blocks (NB,) int32, out (Q, >= 16 nb) float32 (rows contiguous). Each key block is
    loaded once for all Q queries."""
    if not kv_vector_ok(kk):
        return None
    sig = types.void(q, kk, blocks, b0, nb, out)
    bf16 = kk.dtype == types.uint16

    def codegen(context, builder, signature, args):
        qv, kv, bv, b0v, nbv, ov = args
        qa, (Q, D), (qs0, qs1) = _array(context, builder, signature.args[0], qv)
        ka, _, (ks0, ks1, _) = _array(context, builder, signature.args[1], kv)
        ba, _, (bs,) = _array(context, builder, signature.args[2], bv)
        oa, _, (os0, os1) = _array(context, builder, signature.args[5], ov)

        def body(n):
            Gb = score_chains(n)
            with cgutils.for_range_slice(builder, _c(0), nbv, _c(Gb)) as (i0, _):
                slots = _chains(builder, i0, nbv, Gb)
                kp = [_at(builder, ka.data, builder.mul(_block(builder, ba, bs, builder.add(b0v, s)), ks0)) for s in slots]
                acc = [[cgutils.alloca_once_value(builder, ir.Constant(_VF, None)) for _ in range(Gb)] for _ in range(n)]
                with cgutils.for_range(builder, D) as loop:
                    d = loop.index
                    qd = [_splat(builder, builder.load(builder.bitcast(
                        _at(builder, qa.data, builder.add(builder.mul(_c(r), qs0), builder.mul(d, qs1))), _F32.as_pointer())))
                        for r in range(n)]
                    for i in range(Gb):
                        k = _load16(builder, builder.gep(kp[i], [builder.mul(d, ks1)]), bf16)
                        for r in range(n):
                            builder.store(builder.call(_fma(builder), [qd[r], k, builder.load(acc[r][i])]), acc[r][i])
                for r in range(n):
                    for i in range(Gb):
                        p = _at(builder, oa.data, builder.add(builder.mul(_c(r), os0), builder.mul(builder.mul(slots[i], _c(V)), os1)))
                        builder.store(builder.load(acc[r][i]), builder.bitcast(p, _VF.as_pointer()), align=4)
        _per_q(builder, Q, body)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def add_values(typingctx, o, e, ebase, vv, blocks, j0, j1):
    """o[i, d] = o[i, d] + e[i, j - ebase] * (value d of key j) for keys j = j0 .. j1 - 1 ascending and
    queries i < Q <= QMAX (key j: row j % 16 of block blocks[j // 16] of vv (P, 16, D) float32 or uint16,
    C-contiguous); o (Q, D) float32, D a multiple of 16, e (Q, W) float32 (rows contiguous). Each value
    row is loaded once for all Q queries. One query: o (D,), e (W,) (its code alone, no switch)."""
    if not kv_vector_ok(vv):
        return None
    sig = types.void(o, e, ebase, vv, blocks, j0, j1)
    bf16 = vv.dtype == types.uint16
    size = 2 if bf16 else 4

    def codegen(context, builder, signature, args):
        ov, ev, ebv, vv_, bv, j0v, j1v = args
        one = signature.args[0].ndim == 1
        if one:
            oa, (D,), (os1,) = _array(context, builder, signature.args[0], ov)
            ea, _, (es1,) = _array(context, builder, signature.args[1], ev)
            Q, os0, es0 = _c(1), _c(0), _c(0)
        else:
            oa, (Q, D), (os0, os1) = _array(context, builder, signature.args[0], ov)
            ea, _, (es0, es1) = _array(context, builder, signature.args[1], ev)
        va, _, (vs0, vs1, _) = _array(context, builder, signature.args[3], vv_)
        ba, _, (bs,) = _array(context, builder, signature.args[4], bv)
        chunks = builder.udiv(D, _c(V))

        def body(n):
            Gc = value_chains(n)
            with cgutils.for_range_slice(builder, _c(0), chunks, _c(Gc)) as (c0, _):
                cs = _chains(builder, c0, chunks, Gc)
                op = [[builder.bitcast(_at(builder, oa.data, builder.add(builder.mul(_c(r), os0),
                                                                        builder.mul(builder.mul(c, _c(V)), os1))), _VF.as_pointer())
                       for c in cs] for r in range(n)]
                acc = [[cgutils.alloca_once(builder, _VF) for _ in range(Gc)] for _ in range(n)]
                for r in range(n):
                    for a, p in zip(acc[r], op[r]):
                        builder.store(builder.load(p, align=4), a)
                with cgutils.for_range_slice(builder, j0v, j1v, _c(1)) as (j, _):
                    row = _at(builder, va.data, builder.add(builder.mul(_block(builder, ba, bs, builder.sdiv(j, _c(V))), vs0),
                                                            builder.mul(builder.srem(j, _c(V)), vs1)))
                    ej = builder.mul(builder.sub(j, ebv), es1)
                    ws = [_splat(builder, builder.load(builder.bitcast(
                        _at(builder, ea.data, builder.add(builder.mul(_c(r), es0), ej)), _F32.as_pointer()))) for r in range(n)]
                    for i, c in enumerate(cs):
                        v = _load16(builder, builder.gep(row, [builder.mul(c, _c(V * size))]), bf16)
                        for r in range(n):
                            a = acc[r][i]
                            builder.store(builder.call(_fma(builder), [ws[r], v, builder.load(a)]), a)
                for r in range(n):
                    for a, p in zip(acc[r], op[r]):
                        builder.store(builder.load(a), p, align=4)
        if one:
            body(1)
        else:
            _per_q(builder, Q, body)
        return context.get_dummy_value()
    return sig, codegen
