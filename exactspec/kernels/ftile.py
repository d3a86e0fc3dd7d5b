"""The float tile: the register tile of tile.py for float32 and bfloat16 weights and for the quantized
formats dequantized in registers (float32 activations), in LLVM IR. tile.py's docstring has the
contract and why it is exact; itile.py builds the integer-dot tile on the same pieces (`FTile`'s
loads, loops and prefetches; `f16_to_f32`)."""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from .cpu import F16C
from .layout import LAYOUTS, NL
from .quant import QK  # k's per quantization group

V = 16  # lanes per LLVM vector
PREFETCH_BYTES = 8192  # software prefetch distance along the weight stream
# Prefetches go to L2 (prefetcht1), not L1 (prefetcht0), which holds one of L1's few fill buffers per line until
# it arrives: measured on Zen 4 streaming a 16384 x 2048 weight (2 threads), Q4_K one row 0.68 -> 0.58 ms, Q6_K
# 1.1 -> 0.78 ms, five rows 1.3-1.5x, 64 rows ~5%; the integer-dot tiles prefetch every line of a group (quants,
# high bits, scales), every quantized tile the lines of a record's shared scales (the float-activation tiles:
# of a group's quants only). Taller float tiles (prompts, cache-resident blocks) keep prefetching into L1.


def f16_to_f32(builder, h):
    """<16 x i16> float16 bits -> <16 x float>, exactly: one `vcvtph2ps` where the target has F16C, else in
    integer ops (the half type without F16C would call a runtime helper the JIT may not have). The same
    values either way (every finite float16 is a float32; files' scales are checked finite at load);
    measured on Zen 4: the integer ops were ~half of a one-row Q4_K group's instructions."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    vi, vf = ir.VectorType(i32, V), ir.VectorType(f32, V)
    if F16C:
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), V)), vf)

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


class FTile:
    """The IR of one tile: mr rows, weights of format `fmt`."""

    def __init__(self, context, builder, signature, args, mr: int, fmt: str, with_x: bool = True):
        xv, m0v, wv, bv, tv = args
        xty, _, wty, _, tty = signature.args
        self.b, self.mr, self.fmt = builder, mr, fmt
        self.i8, self.i16, self.i32, self.i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        self.vf = ir.VectorType(ir.FloatType(), V)
        self.i8p = self.i8.as_pointer()
        wa = context.make_array(wty)(context, builder, wv)
        ta = context.make_array(tty)(context, builder, tv)
        if with_x:  # float rows (the integer-dot tile reads its own, itile.py)
            xa = context.make_array(xty)(context, builder, xv)
            self.sx = builder.udiv(cgutils.unpack_tuple(builder, xa.strides, 2)[0], self.c64(4))
            self.xbase = builder.gep(xa.data, [builder.mul(m0v, self.sx)])  # float*: row m0, k = 0
        self.n = cgutils.unpack_tuple(builder, wa.shape, wty.ndim)[1]  # K (float) or records (quantized)
        sb = cgutils.unpack_tuple(builder, wa.strides, wty.ndim)[0]  # bytes between blocks (a view may skip some)
        base = builder.ptrtoint(wa.data, self.i64)
        self.w = builder.inttoptr(builder.add(base, builder.mul(bv, sb)), self.i8p)  # block b, byte 0
        self.t = builder.bitcast(ta.data, ir.FloatType().as_pointer())
        vf = self.vf
        self.fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                                  "llvm.fma.v16f32")
        self.pf = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [self.i8p, self.i32, self.i32, self.i32]),
            "llvm.prefetch.p0i8")

    def c64(self, v: int):
        return ir.Constant(self.i64, v)

    def vec(self, p, elt, align: int):
        """Load a <16 x elt> at byte pointer p."""
        return self.b.load(self.b.bitcast(p, ir.VectorType(elt, V).as_pointer()), align=align)

    def rows(self, k) -> list:
        """x[m0 + r, k] broadcast to all lanes, r = 0 .. mr-1."""
        b, vf = self.b, self.vf
        bcast = ir.Constant(ir.VectorType(self.i32, V), [0] * V)
        out = []
        for r in range(self.mr):
            xr = b.load(b.gep(self.xbase, [b.add(b.mul(self.c64(r), self.sx), k)]))
            xr = b.insert_element(ir.Constant(vf, ir.Undefined), xr, ir.Constant(self.i32, 0))
            out.append(b.shuffle_vector(xr, ir.Constant(vf, ir.Undefined), bcast))
        return out

    def prefetch(self, p) -> None:
        b, i32 = self.b, self.i32
        float_tall = self.mr > 1 and self.fmt in ("f32", "bf16")
        b.call(self.pf, [b.gep(p, [self.c64(PREFETCH_BYTES)]), ir.Constant(i32, 0),
                         ir.Constant(i32, 3 if float_tall else 2), ir.Constant(i32, 1)])

    def loop(self, n, acc_in: list, body) -> list:
        """for i in range(n) (n >= 1): acc = body(i, acc); the accumulators are phi nodes."""
        b = self.b
        pre = b.block
        head = b.append_basic_block("tile.loop")
        after = b.append_basic_block("tile.after")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(self.i64)
        i.add_incoming(self.c64(0), pre)
        acc = [b.phi(self.vf) for _ in acc_in]
        for p, v in zip(acc, acc_in):
            p.add_incoming(v, pre)
        new = body(i, acc)
        end = b.block  # the body may have opened blocks of its own (an inner loop)
        i1 = b.add(i, self.c64(1))
        i.add_incoming(i1, end)
        for p, v in zip(acc, new):
            p.add_incoming(v, end)
        b.cbranch(b.icmp_signed("<", i1, n if isinstance(n, ir.Value) else self.c64(n)), head, after)
        b.position_at_end(after)
        return new

    def step(self, k, w: list, acc: list) -> list:
        """One k: acc[r, v] = fma(x[m0 + r, k], w[v], acc[r, v]) (acc flat, row-major)."""
        xs = self.rows(k)
        return [self.b.call(self.fma, [xs[i // (NL // V)], w[i % (NL // V)], a]) for i, a in enumerate(acc)]

    def float_body(self, k, acc: list) -> list:
        b, bf16 = self.b, self.fmt == "bf16"
        size = 2 if bf16 else 4
        row = b.gep(self.w, [b.mul(k, self.c64(NL * size))])
        for line in range(NL * size // 64):  # every cache line of the k-row (1 for bf16, 2 for f32)
            self.prefetch(b.gep(row, [self.c64(64 * line)]))
        ws = []
        for v in range(NL // V):
            p = b.gep(row, [self.c64(v * V * size)])
            if bf16:  # bfloat16 -> float32 is exact: the bf16 bits are the top half of the float32
                wvec = b.zext(self.vec(p, self.i16, 2), ir.VectorType(self.i32, V))
                ws.append(b.bitcast(b.shl(wvec, ir.Constant(ir.VectorType(self.i32, V), [16] * V)), self.vf))
            else:
                ws.append(self.vec(p, ir.FloatType(), 4))
        return self.step(k, ws, acc)

    def halves(self, p, off: int) -> list:
        """The NL float16 lanes at byte p + off, widened: NL/V vectors."""
        b = self.b
        return [f16_to_f32(b, self.vec(b.gep(p, [self.c64(off + 2 * V * v)]), self.i16, 2)) for v in range(NL // V)]

    def record_body(self, rec, acc: list) -> list:
        """Record rec of a quantized format: its float16 scales (and minimums) widened once, then its
        groups in order (`group_body`; a K-quant's record is a super-block of layout.SUPER groups)."""
        b, F = self.b, LAYOUTS[self.fmt]
        rb = b.gep(self.w, [b.mul(rec, self.c64(F.record_bytes))])
        for off in range(F.d_at, F.record_bytes, 64):  # the shared lines (the groups prefetch their own)
            self.prefetch(b.gep(rb, [self.c64(off)]))
        shared = (self.halves(rb, F.d_at), self.halves(rb, F.m_at) if F.has_min else None)
        if F.groups == 1:
            return self.group_body(rec, rb, shared, acc)

        def group(j, acc):
            return self.group_body(b.add(b.mul(rec, self.c64(F.groups)), j), b.gep(rb, [b.mul(j, self.c64(F.group_bytes))]),
                                   shared, acc)
        return self.loop(F.groups, acc, group)

    def group_body(self, g, gb, shared: tuple, acc: list) -> list:
        """Group g of a quantized format (its bytes at gb; its record's widened (d, m)): QK k's."""
        b, F = self.b, LAYOUTS[self.fmt]
        scales, mins = shared
        v8 = ir.VectorType(self.i8, V)
        if F.sub_scales:  # q4_k: d * sc and -(dmin * mn), exact
            def bytes_(off):
                return [b.uitofp(self.vec(b.gep(gb, [self.c64(off + V * v)]), self.i8, 1), self.vf) for v in range(NL // V)]
            scales = [b.fmul(d, s) for d, s in zip(scales, bytes_(F.sc_at))]
            mins = [b.fneg(b.fmul(d, m)) for d, m in zip(mins, bytes_(F.mn_at))]
        if F.sc16:  # q6_k: d * sc for k's 0..15 and for 16..31 (int8 scales), exact
            def signed(off):
                return [b.sitofp(self.vec(b.gep(gb, [self.c64(off + V * v)]), self.i8, 1), self.vf) for v in range(NL // V)]
            halves16 = [[b.fmul(d, s) for d, s in zip(scales, signed(F.sc_at + h * NL))] for h in range(2)]

        def weights(row, kq) -> list:
            """The NL dequantized weights of k-row kq of the group (its bytes at `row`), as NL/V vectors."""
            if F.qbits == 8:
                qs = [b.sitofp(self.vec(b.gep(row, [self.c64(V * v)]), self.i8, 1), self.vf) for v in range(NL // V)]
                return [b.fmul(q, s) for q, s in zip(qs, scales)]
            packed = self.vec(row, self.i8, 1)
            nib = [b.and_(packed, ir.Constant(v8, [15] * V)), b.lshr(packed, ir.Constant(v8, [4] * V))]
            for bit in range(4, F.qbits):  # bit j of the k-row's 4 bytes in plane `bit`: lane j's bit `bit`
                hp = b.gep(gb, [b.add(self.c64(F.hb_at + (bit - 4) * QK * NL // 8), b.mul(kq, self.c64(NL // 8)))])
                bits = b.bitcast(b.load(b.bitcast(hp, self.i32.as_pointer()), align=1), ir.VectorType(ir.IntType(1), NL))
                for v in range(NL // V):
                    hv = b.shuffle_vector(bits, bits, ir.Constant(ir.VectorType(self.i32, V), list(range(V * v, V * v + V))))
                    nib[v] = b.or_(nib[v], b.shl(b.zext(hv, v8), ir.Constant(v8, [bit] * V)))
            if F.sc16:  # q6_k: (d * sc) * (q - 32), sc by the half of the group kq is in
                first = b.icmp_signed("<", kq, self.c64(QK // 2))
                return [b.fmul(b.select(first, s0, s1), b.sitofp(b.sub(q, ir.Constant(v8, [F.zero] * V)), self.vf))
                        for q, s0, s1 in zip(nib, *halves16)]
            if F.has_min:  # q4_1/q5_1: d * q + m, q4_k: (d * sc) * q - dmin * mn; one rounding (the product is exact)
                return [b.call(self.fma, [b.uitofp(q, self.vf), s, m]) for q, s, m in zip(nib, scales, mins)]
            off = ir.Constant(v8, [F.zero] * V)
            return [b.fmul(b.sitofp(b.sub(q, off), self.vf), s) for q, s in zip(nib, scales)]

        per_line = 64 // F.row_bytes  # k-rows per cache line: one prefetch for each line

        def line_body(i, acc):
            row0 = b.gep(gb, [b.mul(i, self.c64(64))])
            self.prefetch(row0)
            k0 = b.add(b.mul(g, self.c64(QK)), b.mul(i, self.c64(per_line)))
            for u in range(per_line):  # k ascending, as ever
                kq = b.add(b.mul(i, self.c64(per_line)), self.c64(u))
                acc = self.step(b.add(k0, self.c64(u)), weights(b.gep(row0, [self.c64(u * F.row_bytes)]), kq), acc)
            return acc
        return self.loop(QK // per_line, acc, line_body)

    def build(self) -> None:
        zero = [ir.Constant(self.vf, None)] * (self.mr * (NL // V))
        body = self.float_body if self.fmt in ("f32", "bf16") else self.record_body
        out = self.loop(self.n, zero, body)
        for i, acc in enumerate(out):
            self.b.store(acc, self.tslot(i), align=4)

    def tslot(self, i: int):
        """Where accumulator i (row r = i // 2, vector v = i % 2) is stored: t[r, 16 v ..]."""
        p = self.b.gep(self.t, [self.c64((i // (NL // V)) * NL + (i % (NL // V)) * V)])
        return self.b.bitcast(p, self.vf.as_pointer())
