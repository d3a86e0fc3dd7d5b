"""The integer-dot register tile (LLVM IR), for weights in an integer-dot layout (layout.py) and int8
activations (actquant.py): `tile.run_tile(mr, (q, d, s), m0, w, b, t)`.

Per group of 32 k's (Q6_K: per 16), each output's sum of u * q (unsigned weight quants times int8
activations, less the zero point times the activations' sum) is an integer sum: exact in int32
(|sum| <= 32 * 255 * 128 < 2^20), so any instruction and order gives the same
value. By the target (cpu.py): AVX512-VNNI `vpdpbusd` (4 products per 32-bit lane, no saturation); AVX-VNNI
the same instruction on 256-bit halves; AVX2 `vpmaddubsw` (unsigned x signed bytes, adjacent pairs summed
in int16 with saturation), the pair sums of up to `cap` quads added in int16, then `vpmaddwd` by ones
(pairs of those in int32): nothing saturates or wraps, since the activations are in [-127, 127] and the
quants at most 15, 31 or 63 (4, 5, 6 bits: 8 * 2 * 15 * 127 = 30480, 4 * 2 * 31 * 127, 2 * 2 * 63 * 127 =
32004 < 32767), while 8-bit weights (u = w + 128) go one quad at a time as |w| <= 128 against the
activations with w's sign (`vpsignb`; 2 * 128 * 127 = 32512), their sum then sum w*q = sum u*q - 128 s
itself; elsewhere widening multiplies and adds. (Summing in int16 first was measured under a "haswell" name that
was AVX-512 code then: a 1536 x 768 weight at 64 rows 0.76 -> 0.62 ms on Q4_1; as AVX2 code, on an Intel Xeon,
5- and 6-bit weights widened every quad instead measured no different.) On the 16-register targets (AVX2,
AVX-VNNI) each quad's sums are pinned (`pin`) so that LLVM schedules quad by quad. Then the group's float
combine (actquant.py's docstring), the same fixed sequence of operations for every row count, tile height,
thread count and CPU. A tile has at most cpu.MR_INT rows: each row holds its float and its integer accumulators
in registers (AVX2, AVX-VNNI: its float ones in the tile's buffer between groups, `mem_acc`; from 2 rows
on, half tiles of one output vector and up to cpu.MR_HALF rows, tile.py).
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from .cpu import AVXVNNI, MADDUBS, VNNI
from .layout import LAYOUTS, NL
from .quant import QK
from .ftile import V, FTile


class ITile(FTile):
    """The IR of one integer-dot tile: mr rows, weights of the integer-dot layout `fmt`."""

    def __init__(self, context, builder, signature, args, mr: int, fmt: str, vs: tuple = tuple(range(NL // V))):
        """vs: the output vectors of the block it computes (all; a half tile: one, its lanes 16 v ..)."""
        self.vs = vs
        xv, m0v, wv, bv, tv = args
        xty, _, wty, _, tty = signature.args
        super().__init__(context, builder, signature, args, mr, fmt, with_x=False)
        arrs = [context.make_array(ty)(context, builder, builder.extract_value(xv, i)) for i, ty in enumerate(xty.types)]
        qa, da, sa = arrs
        rs = [builder.udiv(cgutils.unpack_tuple(builder, a.strides, 2)[0], self.c64(sz)) for a, sz in zip(arrs, (1, 4, 4))]
        self.sq, self.sd, self.ss = rs
        self.qbase = builder.gep(qa.data, [builder.mul(m0v, self.sq)])  # int8*: row m0, k = 0
        self.dbase = builder.gep(da.data, [builder.mul(m0v, self.sd)])  # float*: row m0, group 0
        self.sbase = builder.gep(sa.data, [builder.mul(m0v, self.ss)])  # i32*: row m0, group 0
        self.vi = ir.VectorType(self.i32, V)
        self.vb = ir.VectorType(self.i8, 4 * V)
        self.signed8 = MADDUBS and LAYOUTS[fmt].qbits == 8  # sum w*q, not sum u*q
        # AVX2: quads whose pair sums add up in int16 before one `vpmaddwd` (|sum| <= cap * 2 * umax * 127 < 2^15:
        # 4-bit 8 * 2 * 15 * 127 = 30480, 5-bit 4 * 2 * 31 * 127, 6-bit 2 * 2 * 63 * 127, 8-bit (|w| <= 128) 1)
        self.cap = {4: 8, 5: 4, 6: 2, 8: 1}[LAYOUTS[fmt].qbits] if MADDUBS else 0
        # 16 registers (AVX2, AVX-VNNI): the float accumulators stay in t between groups (the registers hold a
        # group's integer sums, the weights and the broadcasts; half tiles store only their own slots)
        self.mem_acc = MADDUBS or AVXVNNI
        # a half tile's accumulators are its own slots of t (FTile.build's phis would store every slot)
        assert self.mem_acc or len(vs) == NL // V, "half tiles need mem_acc"
        m = builder.module
        if VNNI:
            self.dp = cgutils.get_or_insert_function(m, ir.FunctionType(self.vi, [self.vi] * 3),
                                                     "llvm.x86.avx512.vpdpbusd.512")
        v8, b32, w16 = ir.VectorType(self.i32, 8), ir.VectorType(self.i8, 32), ir.VectorType(self.i16, 16)
        if AVXVNNI:
            self.dp = cgutils.get_or_insert_function(m, ir.FunctionType(v8, [v8] * 3), "llvm.x86.avx512.vpdpbusd.256")
        elif MADDUBS:
            self.maddubs = cgutils.get_or_insert_function(m, ir.FunctionType(w16, [b32, b32]), "llvm.x86.avx2.pmadd.ub.sw")
            self.maddwd = cgutils.get_or_insert_function(m, ir.FunctionType(v8, [w16, w16]), "llvm.x86.avx2.pmadd.wd")
            self.psign = cgutils.get_or_insert_function(m, ir.FunctionType(b32, [b32, b32]), "llvm.x86.avx2.psign.b")
            self.pabs = cgutils.get_or_insert_function(m, ir.FunctionType(b32, [b32, ir.IntType(1)]), "llvm.abs.v32i8")

    @property
    def slots(self) -> list[int]:
        """The accumulators it computes: i = r * 2 + v for its rows r and vectors v."""
        return [r * (NL // V) + v for r in range(self.mr) for v in self.vs]

    def pin(self, v):
        """v itself, through an empty asm (no instruction; v stays in its register). Pinning each quad's sums
        keeps the schedule quad by quad: without it LLVM's scheduler ran one accumulator through the whole group
        at a time and spilled every loaded weight vector to reuse it for the others (a 2-row Q4_1 tile at the
        haswell level: 571 vector spills and fills in linear_block -> 139; a 1536 x 768 weight at 64 rows
        0.78 -> 0.62 ms, with the float accumulators kept in t (mem_acc) 0.58; AVX-VNNI 0.67 -> 0.42 ms)."""
        return self.b.asm(ir.FunctionType(v.type, [v.type]), "", "=x,0", [v], False)

    def build(self) -> None:
        if not self.mem_acc:
            return super().build()
        for i in self.slots:
            self.b.store(ir.Constant(self.vf, None), self.tslot(i), align=4)
        self.loop(self.n, [], self.record_body)

    def bcast(self, v, vty):
        b = self.b
        e = b.insert_element(ir.Constant(vty, ir.Undefined), v, ir.Constant(self.i32, 0))
        return b.shuffle_vector(e, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(self.i32, V), [0] * V))

    def split(self, v, n: int) -> list:
        """A vector's two halves (n lanes each)."""
        return [self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(self.i32, n), list(range(h * n, h * n + n))))
                for h in range(2)]

    def join(self, lo, hi):
        """Two <8 x i32> halves as one <16 x i32>."""
        return self.b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(self.i32, 16), list(range(16))))

    def madd16(self, u, s) -> list:
        """AVX2: the two 256-bit halves of a quad's pair sums, <16 x i16> each: u[2j] * s[2j] + u[2j+1] * s[2j+1]
        (`vpmaddubsw`). With `signed8` (8-bit quants): (u - 128) * s, the sum less 128 * sum s."""
        b = self.b
        out = []
        for x, y in zip(self.split(b.bitcast(u, self.vb), 32), self.split(b.bitcast(s, self.vb), 32)):
            if self.signed8:  # w = u - 128 as a signed byte: |w| (as unsigned) against s with w's sign
                w = b.xor(x, ir.Constant(x.type, [0x80] * 32))
                x, y = b.call(self.pabs, [w, ir.Constant(ir.IntType(1), 0)]), b.call(self.psign, [y, w])
            out.append(b.call(self.maddubs, [x, y]))
        return out

    def widen(self, acc, p16: list):
        """acc[l] + the int16 sums p16 (two halves) of lane l's 4 k's, each pair added in int32 (`vpmaddwd`)."""
        b = self.b
        ones = ir.Constant(ir.VectorType(self.i16, 16), [1] * 16)
        return self.join(*[b.add(a, b.call(self.maddwd, [p, ones])) for a, p in zip(self.split(acc, 8), p16)])

    def islot(self, i: int):
        """AVX2: where integer accumulator i waits between its widens: accumulator i's slot mr rows down in t
        (rows mr .. 2 mr - 1: linear.py's tile buffer has them)."""
        return self.b.bitcast(self.tslot(i + self.mr * (NL // V)), self.vi.as_pointer())

    def widen_stashed(self, i: int, acc, p16: list, last: bool):
        """widen, with the integer accumulator i in memory between the widens of a chain (a 5-, 6- or 8-bit
        group widens 2, 4 or 8 times): kept in registers it held 8 of the 16 while the next quads' int16 sums
        took 8 more, and LLVM spilled (a 2-row Q5_K group: 96 spills and fills). `acc` None: in the slot."""
        if acc is None:
            acc = self.b.load(self.islot(i), align=4)
        acc = self.widen(acc, p16)
        if last or self.cap == 1:  # (8-bit: a widen every quad, through memory measured 0.81 -> 0.97 ms)
            return acc
        self.b.store(acc, self.islot(i), align=4)
        return None

    def dot(self, acc, u, s):
        """acc[l] + sum_{i<4} u[4l + i] * s[4l + i]: u unsigned, s signed bytes (<64 x i8> or <16 x i32>).
        (AVX2 takes madd16 and widen instead.)"""
        b = self.b
        if VNNI:
            return b.call(self.dp, [acc, b.bitcast(u, self.vi), b.bitcast(s, self.vi)])
        if AVXVNNI:
            v8 = ir.VectorType(self.i32, 8)
            return self.join(*[b.call(self.dp, [a, b.bitcast(x, v8), b.bitcast(y, v8)])
                               for a, x, y in zip(self.split(acc, 8), self.split(b.bitcast(u, self.vb), 32),
                                                  self.split(b.bitcast(s, self.vb), 32))])
        i16, i32 = ir.VectorType(self.i16, 4 * V), ir.VectorType(self.i32, 2 * V)
        p = b.mul(b.zext(b.bitcast(u, self.vb), i16), b.sext(b.bitcast(s, self.vb), i16))  # |u * s| <= 255 * 128

        def half(v, n, ty):
            ev = b.sext(b.shuffle_vector(v, v, ir.Constant(ir.VectorType(self.i32, n), list(range(0, 2 * n, 2)))), ty)
            od = b.sext(b.shuffle_vector(v, v, ir.Constant(ir.VectorType(self.i32, n), list(range(1, 2 * n, 2)))), ty)
            return b.add(ev, od)
        p2 = half(p, 2 * V, i32)
        p4 = half(p2, V, self.vi)
        return b.add(acc, p4)

    def group_body(self, g, gb, shared: tuple, acc: list) -> list:
        b, F, vf, vi = self.b, LAYOUTS[self.fmt], self.vf, self.vi
        quad_bytes = 4 * F.row_bytes  # the quad's quants (5-bit: its nibbles; its high bits at hb_at)
        nlines = -(-F.group_bytes // 64)
        # independent integer chains per output (exact: any split); q6_k: one per 16 k's (its own scale)
        cap = self.cap
        nacc = 2 if (self.mr <= 2 and VNNI) or F.sc16 else 1
        a16: dict = {}  # AVX2: (output vector, half) -> (int16 partial sums, quads in them)
        zero = ir.Constant(vi, None)
        iacc = [[zero] * nacc for _ in range(self.mr * (NL // V))]
        xrow = [b.gep(self.qbase, [b.add(b.mul(self.c64(r), self.sq), b.mul(g, self.c64(QK)))]) for r in range(self.mr)]
        for u in range(QK // 4):
            row = b.gep(gb, [self.c64(u * quad_bytes)])
            for line in range(nlines):  # every line of the group (quants, high bits, scales), spread over the quads
                if line * (QK // 4) // nlines == u:
                    self.prefetch(b.gep(gb, [self.c64(64 * line)]))
            if F.qbits == 8:
                ws = {v: b.load(b.bitcast(b.gep(row, [self.c64(4 * V * v)]), self.vb.as_pointer()), align=1)
                      for v in self.vs}
            else:
                packed = b.load(b.bitcast(row, self.vb.as_pointer()), align=1)
                ws = {v: b.and_(packed, ir.Constant(self.vb, [15] * (4 * V))) if v == 0 else
                      b.lshr(packed, ir.Constant(self.vb, [4] * (4 * V))) for v in self.vs}
                if F.fields:  # bit 4 (and 5): the field of quad u in its set's v-th 64-byte vector, moved to
                    # bit 4 by one shift (none for the set's quad whose field is there) and masked
                    f, per = F.fields, F.per_byte
                    for v in self.vs:
                        hp = b.gep(gb, [self.c64(F.hb_at + ((u // per) * 2 + v) * 4 * V)])
                        h = b.load(b.bitcast(hp, self.vb.as_pointer()), align=1)
                        sh = 4 - f * (u % per)
                        if sh > 0:
                            h = b.shl(h, ir.Constant(self.vb, [sh] * (4 * V)))
                        elif sh < 0:
                            h = b.lshr(h, ir.Constant(self.vb, [-sh] * (4 * V)))
                        mask = ((1 << f) - 1) << 4
                        ws[v] = b.or_(ws[v], b.and_(h, ir.Constant(self.vb, [mask] * (4 * V))))
                for bit in range(4, 4 if F.fields else F.qbits):  # bit i of the quad's v-th uint64 in plane `bit`
                    for v in self.vs:
                        hp = b.gep(gb, [self.c64(F.hb_at + (bit - 4) * QK * NL // 8 + u * 2 * 8 + 8 * v)])
                        bits = b.bitcast(b.load(b.bitcast(hp, self.i64.as_pointer()), align=1),
                                         ir.VectorType(ir.IntType(1), 4 * V))
                        ws[v] = b.or_(ws[v], b.shl(b.zext(bits, self.vb), ir.Constant(self.vb, [bit] * (4 * V))))
            for r in range(self.mr):
                xq = b.load(b.bitcast(b.gep(xrow[r], [self.c64(4 * u)]), self.i32.as_pointer()), align=1)
                xb = self.bcast(xq, vi)
                for v in self.vs:
                    a = iacc[r * (NL // V) + v]
                    h = u // 4 if F.sc16 else u % nacc  # q6_k: a sum per 16 k's (its own scale)
                    if not cap:
                        a[h] = self.dot(a[h], ws[v], xb)
                        continue
                    p16, n = self.madd16(ws[v], xb), 1  # a quad's pair sums; `cap` quads summed in int16
                    if (i16 := (r * (NL // V) + v, h)) in a16:
                        p16, n = [b.add(x, y) for x, y in zip(a16[i16][0], p16)], a16[i16][1] + 1
                    a16[i16] = (p16, n)
                    if n == cap:  # (the chain's last quad: its sum stays in registers for the combine)
                        a[h] = self.widen_stashed(r * (NL // V) + v, a[h], a16.pop(i16)[0],
                                                  last=u % 4 == 3 if F.sc16 else u == QK // 4 - 1)
            if MADDUBS or AVXVNNI:  # 16 ymm registers: this quad's sums done before the next quad's work (pin)
                for key, (p16, n) in a16.items():
                    a16[key] = ([self.pin(x) for x in p16], n)
                for a in iacc:
                    for h in range(len(a)):
                        if a[h] is not zero and a[h] is not None:
                            a[h] = self.join(*[self.pin(x) for x in self.split(a[h], 8)])
            if F.sc16 and u == QK // 8 - 1:  # q6_k: k's 0..15 summed: their combine now (the same float operations
                # in the same order as at the group's end), so their integer sums leave the registers
                for key in [key for key in a16 if key[1] == 0]:
                    iacc[key[0]][0] = self.widen_stashed(key[0], iacc[key[0]][0], a16.pop(key)[0], last=True)
                acc = self.combine16(g, gb, shared[0], acc, iacc, xrow, 0)
        for (i, h), (p16, _) in a16.items():
            iacc[i][h] = self.widen_stashed(i, iacc[i][h], p16, last=True)
        if F.sc16:
            return self.combine16(g, gb, shared[0], acc, iacc, xrow, 1)
        isum = [a[0] if nacc == 1 else b.add(a[0], a[1]) for a in iacc]
        dw, mins = shared
        if F.sub_scales:
            def bytes_(off):
                return [b.uitofp(self.vec(b.gep(gb, [self.c64(off + V * v)]), self.i8, 1), vf) for v in range(NL // V)]
            dw = [b.fmul(d, s) for d, s in zip(dw, bytes_(F.sc_at))]
            mins = [b.fneg(b.fmul(d, m)) for d, m in zip(mins, bytes_(F.mn_at))]
        offset = 0 if self.signed8 else F.zero
        acc = self.loaded(acc)
        for r in range(self.mr):
            dx = b.load(b.gep(self.dbase, [b.add(b.mul(self.c64(r), self.sd), g)]))
            sx = b.load(b.gep(self.sbase, [b.add(b.mul(self.c64(r), self.ss), g)]))
            dxv = self.bcast(dx, vf)
            if F.has_min:
                sxf = self.bcast(b.fmul(dx, b.sitofp(sx, ir.FloatType())), vf)
            for v in self.vs:
                i = r * (NL // V) + v
                s = isum[i]
                if offset:
                    s = b.sub(s, self.bcast(b.mul(sx, ir.Constant(self.i32, offset)), vi))
                a = b.call(self.fma, [b.sitofp(s, vf), b.fmul(dw[v], dxv), acc[i]])
                if F.has_min:
                    a = b.call(self.fma, [mins[v], sxf, a])
                acc[i] = a
        return self.stored(acc)

    def loaded(self, acc: list) -> list:
        """The float accumulators at a group's combine: the phis `acc`, or with mem_acc from t."""
        if not self.mem_acc:
            return list(acc)
        return [self.b.load(self.tslot(i), align=4) if i in self.slots else None for i in range(self.mr * (NL // V))]

    def stored(self, acc: list) -> list:
        """After the combine: the new accumulators as phis, or with mem_acc stored back into t (none)."""
        if not self.mem_acc:
            return acc
        for i, a in enumerate(acc):
            if a is not None:
                self.b.store(a, self.tslot(i), align=4)
        return []

    def combine16(self, g, gb, d: list, acc: list, iacc: list, xrow: list, h: int) -> list:
        """q6_k's float combine of half h of the group (k's 0..15, then 16..31, each as soon as its sums are
        done): acc = fma(f32(sum (u - 32) q), (f32(d) * f32(sc_h)) * dx, acc), the integer sum taken as
        sum u q - 32 sum q (the same int32; u: the stored quants 0..63, q: the row's int8 activations; the
        half's sum of q: half 0's 16 bytes summed, half 1's the group's s less that)."""
        b, F, vf, vi = self.b, LAYOUTS[self.fmt], self.vf, self.vi
        v16 = ir.VectorType(self.i32, 16)
        red = cgutils.get_or_insert_function(b.module, ir.FunctionType(self.i32, [v16]), "llvm.vector.reduce.add.v16i32")
        xsum = []  # (row) -> 32 * the half's sum of q
        for r in range(self.mr):
            h0 = b.call(red, [b.sext(self.vec(xrow[r], self.i8, 1), v16)])
            if h:
                h0 = b.sub(b.load(b.gep(self.sbase, [b.add(b.mul(self.c64(r), self.ss), g)])), h0)
            xsum.append(self.bcast(b.shl(h0, ir.Constant(self.i32, 5)), vi))
        s = [b.fmul(d[v], b.sitofp(self.vec(b.gep(gb, [self.c64(F.sc_at + h * NL + V * v)]), self.i8, 1), vf))
             for v in range(NL // V)]
        acc = self.loaded(acc)
        for r in range(self.mr):
            dxv = self.bcast(b.load(b.gep(self.dbase, [b.add(b.mul(self.c64(r), self.sd), g)])), vf)
            for v in self.vs:
                i = r * (NL // V) + v
                isum = b.sub(iacc[i][h], xsum[r])
                acc[i] = b.call(self.fma, [b.sitofp(isum, vf), b.fmul(s[v], dxv), acc[i]])
        return self.stored(acc)
