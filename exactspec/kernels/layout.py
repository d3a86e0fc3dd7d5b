"""The packed byte layout of quantized weights: per block of NL output lanes and record of QK k's (the
K-quants: of a super-block of SUPER groups of QK k's), the quants and per-group scales, then the lanes'
float16 scales (and minimums) of the record. Shared by the packer (pack.py), the register tiles
(ftile.py, itile.py) and the embedding lookup (model/forward.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .quant import QK, ZERO  # k's per quantization group; zero points

NL = 32  # output lanes per packed block (2 vectors of 16)
SUPER = 8  # groups of a K-quant super-block (256 k's): their float16 d (and dmin) kept once


@dataclass(frozen=True)
class Format:
    """A quantized layout: per block and record of `groups` groups of QK k's (1; the K-quants: SUPER, a
    file's super-block), each group's `group_bytes`: its `qbits`-bit quants (k-major, lane-minor; 4-bit:
    byte j of a k-row holds lane j in its low nibble and lane j + 16 in its high one; 5-bit: those nibbles,
    then per k-row 4 bytes whose bit j (little-endian) is lane j's bit 4; 6-bit: those nibbles, then as
    many for bit 5), then (sub_scales, Q4_K, Q5_K) NL uint8 group scales sc and NL uint8 group minimums
    mn, or (sc16, Q6_K) NL int8 scales of k's 0..15 and NL of k's 16..31; after the record's groups, NL
    float16 scales d, then (has_min) NL float16 minimums m, shared by its groups. Dequantized weight:
    q8_0: f32(d) * f32(q) (q int8);
    q4_0: f32(d) * f32(q - 8); q4_1: fma(f32(q), f32(d), f32(m)); q4_k, q5_k: fma(f32(q), f32(d) * f32(sc),
    -(f32(m) * f32(mn))) -- every product is exact in float32 (at most 11 + 8 significant bits), so
    each is the gguf package's value (kernels/quant.py), and a sum rounds once whether fused or not.
    Offsets: hb_at, sc_at, mn_at from the group's first byte; d_at, m_at from the record's."""
    name: str
    qbits: int
    has_min: bool
    sub_scales: bool = False
    int_dot: bool = False  # the integer-dot order (below), for int8 activations (kernels/itile.py)
    sc16: bool = False  # q6_k: a signed 8-bit scale per 16 k's (two per group), no minimum

    @property
    def base(self) -> str:
        """The weight format (quant.FORMATS) this layout holds."""
        return self.name[:-1] if self.int_dot else self.name

    @property
    def zero(self) -> int:
        """The stored quant of weight 0 (value = scale * (stored - zero)): quant.ZERO's, and for Q8_0's
        integer-dot layout 128 (its int8 quants stored + 128, unsigned); 0 where a format has a minimum."""
        return 128 if self.name == "q8_0i" else ZERO.get(self.base, 0)

    @property
    def fields(self) -> int:
        """The width of the high-bit fields of an integer-dot layout of 5- or 6-bit quants (1 or 2; else 0):
        bit 4 (and 5) kept as fields of `per_byte` quads in each byte, not as bit planes, so a quad's high bits
        take one shift and mask (a plane's bits took a mask expansion: vpshufb, vpand, vpcmpeqb on AVX2)."""
        return self.qbits - 4 if self.int_dot and self.qbits in (5, 6) else 0

    @property
    def per_byte(self) -> int:
        """Quads whose high-bit fields share a byte (8 // fields)."""
        return 8 // self.fields if self.fields else 0

    @property
    def nibbles(self) -> bool:
        """4-, 5- and 6-bit quants: a plane of nibbles (5-bit: then a plane of their bit 4; 6-bit: a
        plane of bit 4, then one of bit 5)."""
        return self.qbits in (4, 5, 6)

    @property
    def row_bytes(self) -> int:  # one k-row of a block's quants (5-bit: of its nibbles)
        return NL * min(self.qbits, 4) // 8 if self.nibbles else NL

    @property
    def groups(self) -> int:
        """Groups per record: a K-quant's super-block (its d and dmin once), else 1."""
        return SUPER if self.sub_scales or self.sc16 else 1

    # Byte offsets in a group: the high bits (5-, 6-bit) after the nibbles, then sc and mn (NL uint8 each;
    # Q6_K: 2 NL int8); in a record: d (NL float16) after its groups, then m (NL float16).
    @property
    def hb_at(self) -> int:
        return QK * self.row_bytes

    @property
    def sc_at(self) -> int:
        return self.hb_at + max(self.qbits - 4, 0) * (QK * NL // 8) if self.nibbles else self.hb_at

    @property
    def mn_at(self) -> int:
        return self.sc_at + NL

    @property
    def group_bytes(self) -> int:
        """Bytes of one group's own part (the stride between a record's groups)."""
        return self.sc_at + (2 * NL if self.sc16 or self.sub_scales else 0)

    @property
    def d_at(self) -> int:
        return self.groups * self.group_bytes

    @property
    def m_at(self) -> int:
        return self.d_at + 2 * NL

    @property
    def record_bytes(self) -> int:
        return self.m_at + (2 * NL if self.has_min else 0)


_FLOAT = (Format("q8_0", 8, False), Format("q4_0", 4, False), Format("q4_1", 4, True), Format("q4_k", 4, True, True),
          Format("q5_0", 5, False), Format("q5_1", 5, True), Format("q5_k", 5, True, True),
          Format("q6_k", 6, False, sc16=True))
# The integer-dot layouts ("q4_0i", ...): the same scales, minimums and group bytes; the quants of a
# group in 8 quads of 4 k's, each quad lane-major with the lane's 4 k's adjacent (what one 32-bit lane
# of an integer dot product takes): 8-bit: byte u*128 + 4*j + kk holds lane j, k = 4u + kk, as q + 128
# (0..255, unsigned); 4-bit: byte u*64 + 4*(j % 16) + kk holds lane j's q (0..15) in its low nibble for
# j < 16, in its high one for j >= 16; 5- and 6-bit: those nibbles, then the high bits as fields of
# f = qbits - 4 bits (`fields`), 8 / f quads a byte (`per_byte`): byte ((u // per_byte) * 2 + j // 16) * 64 +
# 4 * (j % 16) + kk holds in its bits f * (u % per_byte) and up lane j's bit 4 (and 5) of k = 4u + kk (5-bit: one
# 64-byte vector per 16 lanes holds all 8 quads; 6-bit: 4 quads each; the same 128 and 256 bytes as one and two
# bit planes).
_INT = tuple(Format(f.name + "i", f.qbits, f.has_min, f.sub_scales, True, f.sc16) for f in _FLOAT)
LAYOUTS = {f.name: f for f in _FLOAT + _INT}
GROUP_BYTES = LAYOUTS["q8_0"].record_bytes  # Q8_0 weights are uint8 (nblk, K/QK, GROUP_BYTES)


def record_dtype(fmt: str):
    """The numpy dtype of one record of a 4-bit or integer-dot format: a record whose one field is named
    by the format (so the kernel's type tells the format; Q8_0 is plain uint8 with a last axis of
    GROUP_BYTES)."""
    return np.dtype([(fmt, np.uint8, (LAYOUTS[fmt].record_bytes,))])
