"""The register tile of the linear kernel, written in LLVM IR (numba intrinsics).

Contract: `tile(mr)(x, m0, w, b, t)` computes, for rows m0 .. m0+mr-1 of x (M, K) float32 and the
NL = 32 output lanes of packed weight block b of w (nblk, K, NL) (float32, or uint16 holding
bfloat16 bits; each block's (K, NL) contiguous, the blocks at any stride),
t[r, j] = fma(x[m0+r, K-1], w[b, K-1, j], ... fma(x[m0+r, 0], w[b, 0, j], +0.0)): each output is one chain of fused multiply-adds over k = 0, 1, ..., K-1, nothing else.

Why this is exact on any x86-64 CPU, for any tile shape:
* `llvm.fma` is one correctly rounded IEEE operation: the same bits whether the CPU has an FMA
  unit or LLVM calls libm's fmaf.
* The lanes of a vector are different outputs; a <16 x float> is split into 2 AVX2 registers, 1
  AVX-512 register or 4 SSE registers without changing any lane's arithmetic. No reduction ever
  runs across lanes, so the vector width never enters the result.
* A row's chain does not depend on the other rows of the tile (they only share the weight
  load), so mr = 1 and mr = 10 give the same bits for the same row; the tile height is a speed
  choice (`MR_MAX`, by the registers the target has) and never a numerical one.
* The accumulators are SSA values (phi nodes), so they live in registers across the k loop and
  each weight vector is loaded and widened once per tile.
"""
from __future__ import annotations

import llvmlite.binding as llb
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

NL = 32  # output lanes per packed block (2 vectors of 16)
V = 16  # lanes per LLVM vector
PREFETCH_BYTES = 8192  # software prefetch distance along the weight stream
# One-row tiles prefetch into L2 (prefetcht1): their loop is short, and L1 prefetches (prefetcht0) hold
# one of the few L1 fill buffers each until the line arrives. Taller tiles prefetch into L1. (Measured.)


def _wide_target() -> bool:
    """Does numba compile for a CPU with 32 vector registers (AVX-512)? Only speed depends on it."""
    feats = config.CPU_FEATURES
    if config.CPU_NAME:
        name = config.CPU_NAME
        if not feats:
            return any(s in name for s in ("avx512", "icelake", "sapphire", "cascade", "cooper", "tiger",
                                            "cannonlake", "znver4", "znver5", "graniterapids", "emerald"))
    elif not feats:
        feats = llb.get_host_cpu_features().flatten()
    return "+avx512f" in (feats or "")


# Rows per tile: mr rows x 2 vectors of accumulators, + 2 weight vectors, + broadcasts.
MR_MAX = 10 if _wide_target() else 3


# Q8_0 weights (w as uint8 (nblk, K/QK, GROUP_BYTES)): per block and group of QK = 32 k's, the 32 x 32
# int8 quants (k-major, lane-minor), then the 32 lanes' float16 scales. Lane j's weight at k is
# f32(scale[j]) * f32(q[k, j]): exact in float32 (11 + 8 significant bits), so a Q8_0 tile computes
# the same FMA chains as the float32 tile on the dequantized weights.
QK = 32
GROUP_BYTES = QK * NL + 2 * NL


class _Frame:
    """What both tile bodies share: the operands as pointers (x's row m0, weight block b as `welt`*,
    the output tile), the two intrinsics, the broadcast of x[m0 + r, k], the prefetch, the store."""

    def __init__(self, context, builder, signature, args, welt):
        xv, m0v, wv, bv, tv = args
        xty, _, wty, _, tty = signature.args
        self.b = builder
        self.i64, self.i32, self.vf = ir.IntType(64), ir.IntType(32), ir.VectorType(ir.FloatType(), V)
        xa = context.make_array(xty)(context, builder, xv)
        self.wa = context.make_array(wty)(context, builder, wv)
        ta = context.make_array(tty)(context, builder, tv)
        self.sx = builder.udiv(cgutils.unpack_tuple(builder, xa.strides, 2)[0], ir.Constant(self.i64, 4))
        self.xbase = builder.gep(xa.data, [builder.mul(m0v, self.sx)])  # float*: row m0, k = 0
        sb = cgutils.unpack_tuple(builder, self.wa.strides, 3)[0]  # bytes between blocks (a view may skip some)
        self.wbase = builder.inttoptr(builder.add(builder.ptrtoint(self.wa.data, self.i64), builder.mul(bv, sb)),
                                      welt.as_pointer())
        self.tbase = builder.bitcast(ta.data, ir.FloatType().as_pointer())
        vf = self.vf
        self.fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                                  "llvm.fma.v16f32")
        self.i8p = ir.IntType(8).as_pointer()
        self.pf = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [self.i8p, self.i32, self.i32, self.i32]),
            "llvm.prefetch.p0i8")

    def c64(self, v: int):
        return ir.Constant(self.i64, v)

    def rows(self, k, mr: int) -> list:
        """x[m0 + r, k] broadcast to all lanes, r = 0 .. mr-1."""
        b, vf = self.b, self.vf
        bcast = ir.Constant(ir.VectorType(self.i32, V), [0] * V)
        out = []
        for r in range(mr):
            xr = b.load(b.gep(self.xbase, [b.add(b.mul(self.c64(r), self.sx), k)]))
            xr = b.insert_element(ir.Constant(vf, ir.Undefined), xr, ir.Constant(self.i32, 0))
            out.append(b.shuffle_vector(xr, ir.Constant(vf, ir.Undefined), bcast))
        return out

    def prefetch(self, ptr, mr: int) -> None:
        i32 = self.i32
        self.b.call(self.pf, [self.b.bitcast(ptr, self.i8p), ir.Constant(i32, 0), ir.Constant(i32, 2 if mr == 1 else 3),
                              ir.Constant(i32, 1)])

    def accumulators(self, mr: int, pre) -> list:
        """mr x NL/V phi vectors, +0.0 on entry from `pre`."""
        acc = [[self.b.phi(self.vf) for _ in range(NL // V)] for _ in range(mr)]
        self.link(acc, [[ir.Constant(self.vf, None)] * (NL // V)] * mr, pre)
        return acc

    @staticmethod
    def link(phis: list, vals: list, block) -> None:
        """phis[r][v] takes vals[r][v] when control comes from `block` (a loop's back edge)."""
        for prow, vrow in zip(phis, vals):
            for p, v in zip(prow, vrow):
                p.add_incoming(v, block)

    def store(self, new: list, mr: int) -> None:
        for r in range(mr):
            for v in range(NL // V):
                p = self.b.gep(self.tbase, [self.c64(r * NL + v * V)])
                self.b.store(new[r][v], self.b.bitcast(p, self.vf.as_pointer()), align=4)


def _make(mr: int):
    @intrinsic
    def tile(typingctx, x, m0, w, b, t):
        sig = types.void(x, m0, w, b, t)
        if w.dtype == types.uint8:
            return sig, _q8_codegen(mr)
        bf16 = w.dtype == types.uint16

        def codegen(context, builder, signature, args):
            welt = ir.IntType(16) if bf16 else ir.FloatType()
            f = _Frame(context, builder, signature, args, welt)
            i32, vf = f.i32, f.vf
            K = cgutils.unpack_tuple(builder, f.wa.shape, 3)[1]
            pre = builder.block
            loop = builder.append_basic_block("tile.k")
            done = builder.append_basic_block("tile.done")
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(f.i64)
            k.add_incoming(f.c64(0), pre)
            acc = f.accumulators(mr, pre)
            xs = f.rows(k, mr)
            krow = builder.mul(k, f.c64(NL))
            size = 2 if bf16 else 4
            for line in range(NL * size // 64):  # every cache line of the k-row (1 for bf16, 2 for f32)
                f.prefetch(builder.gep(f.wbase, [builder.add(krow, f.c64((PREFETCH_BYTES + 64 * line) // size))]), mr)
            new = [[None] * (NL // V) for _ in range(mr)]
            for v in range(NL // V):
                p = builder.gep(f.wbase, [builder.add(krow, f.c64(v * V))])
                wvec = builder.load(builder.bitcast(p, ir.VectorType(welt, V).as_pointer()), align=2 if bf16 else 4)
                if bf16:  # bfloat16 -> float32 is exact: the bf16 bits are the top half of the float32
                    wvec = builder.zext(wvec, ir.VectorType(i32, V))
                    wvec = builder.bitcast(builder.shl(wvec, ir.Constant(ir.VectorType(i32, V), [16] * V)), vf)
                for r in range(mr):
                    new[r][v] = builder.call(f.fma, [xs[r], wvec, acc[r][v]])
            k1 = builder.add(k, f.c64(1))
            k.add_incoming(k1, loop)
            f.link(acc, new, loop)
            builder.cbranch(builder.icmp_signed("<", k1, K), loop, done)
            builder.position_at_end(done)
            f.store(new, mr)
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _f16_to_f32(builder, h):
    """<16 x i16> float16 bits -> <16 x float>, exactly, in integer ops (no half type: without F16C
    LLVM would call a runtime helper the JIT may not have)."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    vi, vf = ir.VectorType(i32, V), ir.VectorType(f32, V)

    def c(v):
        return ir.Constant(vi, [v] * V)
    hz = builder.zext(h, vi)
    sign = builder.shl(builder.and_(hz, c(0x8000)), c(16))
    e = builder.and_(builder.lshr(hz, c(10)), c(31))
    m = builder.and_(hz, c(0x3FF))
    normal = builder.or_(builder.shl(builder.add(e, c(112)), c(23)), builder.shl(m, c(13)))
    special = builder.or_(c(0x7F800000), builder.shl(m, c(13)))  # inf, nan
    sub = builder.fmul(builder.uitofp(m, vf), ir.Constant(vf, [2.0 ** -24] * V))  # m * 2^-24: exact
    bits = builder.select(builder.icmp_unsigned("==", e, c(0)), builder.bitcast(sub, vi),
                          builder.select(builder.icmp_unsigned("==", e, c(31)), special, normal))
    return builder.bitcast(builder.or_(bits, sign), vf)


def _q8_codegen(mr: int):
    def codegen(context, builder, signature, args):
        i8, i16 = ir.IntType(8), ir.IntType(16)
        f = _Frame(context, builder, signature, args, i8)
        G = cgutils.unpack_tuple(builder, f.wa.shape, 3)[1]  # groups of QK k's
        pre = builder.block
        gloop = builder.append_basic_block("q8.g")
        kloop = builder.append_basic_block("q8.k")
        gnext = builder.append_basic_block("q8.gnext")
        done = builder.append_basic_block("q8.done")
        builder.branch(gloop)
        # outer loop: group g; its NL scales widened once (f16 -> f32 is exact)
        builder.position_at_end(gloop)
        g = builder.phi(f.i64)
        g.add_incoming(f.c64(0), pre)
        gacc = f.accumulators(mr, pre)
        gb = builder.gep(f.wbase, [builder.mul(g, f.c64(GROUP_BYTES))])
        scales = []
        for v in range(NL // V):
            p = builder.gep(gb, [f.c64(QK * NL + 2 * V * v)])
            h = builder.load(builder.bitcast(p, ir.VectorType(i16, V).as_pointer()), align=2)
            scales.append(_f16_to_f32(builder, h))
        gpre = builder.block
        builder.branch(kloop)
        # inner loop: kk = 0 .. QK-1 within the group, k = g * QK + kk
        builder.position_at_end(kloop)
        kk = builder.phi(f.i64)
        kk.add_incoming(f.c64(0), gpre)
        acc = [[builder.phi(f.vf) for _ in range(NL // V)] for _ in range(mr)]
        f.link(acc, gacc, gpre)
        xs = f.rows(builder.add(builder.mul(g, f.c64(QK)), kk), mr)
        krow = builder.gep(gb, [builder.mul(kk, f.c64(NL))])
        f.prefetch(builder.gep(krow, [f.c64(PREFETCH_BYTES)]), mr)
        new = [[None] * (NL // V) for _ in range(mr)]
        for v in range(NL // V):
            p = builder.gep(krow, [f.c64(v * V)])
            q = builder.load(builder.bitcast(p, ir.VectorType(i8, V).as_pointer()), align=1)
            wvec = builder.fmul(builder.sitofp(q, f.vf), scales[v])  # exact: the dequantized weight
            for r in range(mr):
                new[r][v] = builder.call(f.fma, [xs[r], wvec, acc[r][v]])
        kk1 = builder.add(kk, f.c64(1))
        kk.add_incoming(kk1, kloop)
        f.link(acc, new, kloop)
        builder.cbranch(builder.icmp_signed("<", kk1, f.c64(QK)), kloop, gnext)
        builder.position_at_end(gnext)
        g1 = builder.add(g, f.c64(1))
        g.add_incoming(g1, gnext)
        f.link(gacc, new, gnext)
        builder.cbranch(builder.icmp_signed("<", g1, G), gloop, done)
        builder.position_at_end(done)
        f.store(new, mr)
        return context.get_dummy_value()

    return codegen


_t = [_make(mr) for mr in range(1, 11)]
_t1, _t2, _t3, _t4, _t5, _t6, _t7, _t8, _t9, _t10 = _t


@njit(inline="always")
def run_tile(mr, x, m0, w, b, t):
    """t[:mr, :NL] = the FMA chains of rows m0..m0+mr-1 against block b (K >= 1, mr <= MR_MAX)."""
    if mr == 1:
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
