"""GGUF block-quantized weights kept quantized: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (32 weights per block), Q4_K
and Q5_K (256 weights per super-block, in 8 groups of 32 with their own 6-bit scale and minimum) and
Q6_K (256 weights per super-block, an int8 scale per 16).

A `Quantized` holds an (n, k) weight split into per-weight quants and per-block float16 scales (and
Q4_1's and Q4_K's minimums; Q4_K's 6-bit group scales and minimums too), rows in our order. `dequantize` is the one definition of each weight's value,
equal to the gguf package's (llama.cpp's) dequantization to the bit, and the linear kernel
computes it the same way in registers (tile.py, with the layout of layout.py):
    Q8_0: f32(d) * f32(q), q int8            (exact: 11 + 8 significant bits fit in float32)
    Q4_0: f32(d) * f32(q - 8), q in 0..15    (exact)
    Q4_1: f32(d) * f32(q) + f32(m)           (d * q exact, so one rounding, fused or not)
    Q5_0: f32(d) * f32(q - 16), q in 0..31   (exact)
    Q5_1: f32(d) * f32(q) + f32(m)           (as Q4_1)
    Q6_K: (f32(d) * f32(sc)) * f32(q - 32)   (sc int8 per 16 weights, q in 0..63; the gguf package's
                                             expression: the last product may round, once, the same)
    Q4_K: (f32(d) * f32(sc)) * f32(q) - f32(dmin) * f32(mn)   (sc, mn 6-bit per group; every product
                                             exact (11 + 6 + 4 bits), so one rounding, fused or not)
    Q5_K: the same with q in 0..31           (11 + 6 + 5 bits: exact too)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedModelError

QK = 32  # weights per block (and per group of the packed kernel layout)
FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k")
# bytes of one GGUF block: float16 d, (float16 m), (Q5: 32 high bits), then the quants (Q4_K: see from_blocks)
_BLOCK = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}
QK_K = 256  # weights per K-quant super-block
_K_BLOCK = {"q4_k": 144, "q5_k": 176}  # bytes of a Q4_K / Q5_K super-block
ZERO = {"q4_0": 8, "q5_0": 16, "q6_k": 32}  # the quant of weight 0 in the formats without a minimum
QUANTIZERS = tuple(_BLOCK)  # formats the gguf package can quantize to (load(..., quantize=))


@dataclass(frozen=True)
class Quantized:
    fmt: str  # one of FORMATS
    q: np.ndarray  # (n, k): int8 (q8_0) or uint8 0..15 (4-bit formats), 0..31 (5-bit), 0..63 (q6_k)
    d: np.ndarray  # (n, k/32) float16 (K-quants: its super-block's d, for each of its groups)
    m: np.ndarray | None = None  # (n, k/32) float16: q4_1's, q5_1's minimum; q4_k's, q5_k's super-block dmin
    sc: np.ndarray | None = None  # (n, k/32) uint8 0..63, q4_k, q5_k: the group's scale; (n, k/16) int8, q6_k
    mn: np.ndarray | None = None  # (n, k/32) uint8 0..63, q4_k, q5_k: the group's minimum

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def rows(self, f) -> "Quantized":
        """The same tensor with f applied to the row axis of every array (a permutation)."""
        return Quantized(self.fmt, *(None if a is None else f(a) for a in (self.q, self.d, self.m, self.sc, self.mn)))

    def dequantize(self) -> np.ndarray:
        """(n, k) float32: each weight's value, as defined above."""
        n, k = self.q.shape
        q = self.q.reshape(n, k // QK, QK)
        d = self.d.astype(np.float32)[:, :, None]
        if self.fmt == "q8_0":
            w = q.astype(np.float32) * d
        elif self.fmt in ("q4_0", "q5_0"):
            w = (q.astype(np.int8) - np.int8(ZERO[self.fmt])).astype(np.float32) * d
        elif self.fmt == "q6_k":
            s = (d.reshape(n, k // QK, 1, 1) * self.sc.astype(np.float32).reshape(n, k // QK, 2, 1))
            w = s * (q.astype(np.int8) - np.int8(ZERO["q6_k"])).astype(np.float32).reshape(n, k // QK, 2, QK // 2)
        elif self.fmt in ("q4_k", "q5_k"):
            s = d * self.sc.astype(np.float32)[:, :, None]
            c = self.m.astype(np.float32)[:, :, None] * self.mn.astype(np.float32)[:, :, None]
            w = s * q.astype(np.float32) - c
        else:
            w = q.astype(np.float32) * d + self.m.astype(np.float32)[:, :, None]
        return w.reshape(n, k)


# A format's lossless widening: every weight of the first is a weight of the second with the same scales
# (Q4_0's q - 8 is Q5_0's (q + 8) - 16 and Q8_0's int8 q - 8; Q4_1's, Q4_K's 4-bit q are Q5_1's, Q5_K's 5-bit
# q < 16 with the same d, m, sc, mn), so each dequantized weight, each product the float tiles form and each
# integer sum of the integer-dot tiles (the same int32 whatever the zero point: quant - zero is the same
# integer) is the same bits: a kind with more formats over its layers than the Stack keeps is folded into
# fewer this way (model/pack.py) and stays quantized.
WIDER = {"q4_0": "q5_0", "q5_0": "q8_0", "q4_1": "q5_1", "q4_k": "q5_k"}


def widenings(fmt: str) -> list[str]:
    """The formats fmt widens into losslessly, nearest first."""
    out = []
    while fmt in WIDER:
        fmt = WIDER[fmt]
        out.append(fmt)
    return out


def widen(t: Quantized, fmt: str) -> Quantized:
    """The same weights in the wider format `fmt` (one of widenings(t.fmt)): the same values, bit for bit."""
    if fmt != t.fmt and fmt not in widenings(t.fmt):
        raise ValueError(f"{t.fmt} does not widen to {fmt} losslessly (widenings: {widenings(t.fmt)})")
    while t.fmt != fmt:
        to, q = WIDER[t.fmt], t.q
        if to == "q5_0":
            q = q + np.uint8(ZERO["q5_0"] - ZERO["q4_0"])
        elif to == "q8_0":
            q = (q.astype(np.int16) - ZERO["q5_0"]).astype(np.int8)
        t = Quantized(to, q, t.d, t.m, t.sc, t.mn)
    return t


def concat(parts: list[Quantized]) -> Quantized:
    """Row-wise concatenation of tensors of one format."""
    fmt = parts[0].fmt
    assert all(p.fmt == fmt for p in parts)
    return Quantized(fmt, *(None if getattr(parts[0], f) is None else np.concatenate([getattr(p, f) for p in parts])
                            for f in ("q", "d", "m", "sc", "mn")))


def from_blocks(raw: np.ndarray, fmt: str, n: int, k: int) -> Quantized:
    """GGUF blocks (uint8, as stored) of an (n, k) tensor -> Quantized."""
    if fmt in _K_BLOCK:
        return _from_k(raw, fmt, n, k)
    if fmt == "q6_k":
        return _from_q6_k(raw, n, k)
    blocks = np.asarray(raw).view(np.uint8).reshape(n, k // QK, _BLOCK[fmt])
    d = blocks[:, :, :2].copy().view(np.float16).reshape(n, k // QK)
    if fmt == "q8_0":
        return Quantized(fmt, blocks[:, :, 2:].copy().view(np.int8).reshape(n, k), d)
    m = blocks[:, :, 2:4].copy().view(np.float16).reshape(n, k // QK) if fmt in ("q4_1", "q5_1") else None
    qs = blocks[:, :, -QK // 2:]  # byte i: weight i in the low nibble, weight i + 16 in the high one
    q = np.concatenate([qs & 15, qs >> 4], axis=2)
    if fmt in ("q5_0", "q5_1"):  # bit i of the little-endian uint32 before the quants: weight i's bit 4
        at = 4 if fmt == "q5_1" else 2
        qh = blocks[:, :, at:at + 4].copy().view("<u4")  # (n, k/32, 1)
        q = q | (((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
    return Quantized(fmt, q.reshape(n, k), d, m)


def _from_k(raw: np.ndarray, fmt: str, n: int, k: int) -> Quantized:
    """Q4_K super-blocks of 144 bytes: float16 d, float16 dmin, 12 bytes of packed 6-bit scales and
    minimums (unpacked by the gguf package's own `Q4_K.get_scale_min`), 128 bytes of quants: chunk j of
    32 bytes holds group 2j in its low nibbles and group 2j + 1 in its high ones. Q5_K (176 bytes): 32
    bytes of high bits between the scales and the quants, bit g of byte i: bit 4 of group g's weight i."""
    from gguf.quants import Q4_K
    nb = k // QK_K
    blocks = np.asarray(raw).view(np.uint8).reshape(n * nb, _K_BLOCK[fmt])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # (n*nb, 8) each

    def per_group(a):  # a super-block's value for each of its 8 groups
        return np.repeat(a.reshape(n, nb), 8, axis=1)
    d = per_group(blocks[:, 0:2].copy().view(np.float16))
    dmin = per_group(blocks[:, 2:4].copy().view(np.float16))
    qs = blocks[:, -128:].reshape(n * nb, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n * nb, 8, 32)
    if fmt == "q5_k":
        qh = blocks[:, 16:48].reshape(n * nb, 1, 32)
        q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4)
    return Quantized(fmt, q.reshape(n, k), d, dmin, sc.reshape(n, k // QK).astype(np.uint8),
                     mn.reshape(n, k // QK).astype(np.uint8))


def _from_q6_k(raw: np.ndarray, n: int, k: int) -> Quantized:
    """Q6_K super-blocks of 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales
    (one per 16 weights), float16 d; the quants unpacked in the gguf package's own order
    (`Q6_K.dequantize_blocks`)."""
    nb = n * k // QK_K
    b = np.asarray(raw).view(np.uint8).reshape(nb, 210)
    ql = (b[:, :128].reshape(nb, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    qh = (b[:, 128:192].reshape(nb, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (ql.reshape(nb, -1, 32) | (qh.reshape(nb, -1, 32) << 4)).reshape(n, k)
    sc = b[:, 192:208].copy().view(np.int8).reshape(n, k // 16)
    d = np.repeat(b[:, 208:210].copy().view(np.float16).reshape(n, k // QK_K), QK_K // QK, axis=1)
    return Quantized("q6_k", q, d, None, sc)


def quantize(w: np.ndarray, fmt: str, name: str = "weight") -> Quantized:
    """Quantize an (n, k) float array with the gguf package (llama.cpp's rounding)."""
    import gguf
    n, k = w.shape
    if fmt not in _BLOCK:
        raise UnsupportedModelError(f"quantize={fmt!r}: the gguf package has no quantizer for it (kept when a GGUF "
                                    "file has it)")
    if k % QK:
        raise UnsupportedModelError(f"quantize={fmt!r}: {name} has rows of {k} values, not whole blocks of {QK}")
    t = getattr(gguf.GGMLQuantizationType, fmt.upper())
    return from_blocks(gguf.quants.quantize(np.ascontiguousarray(w, np.float32), t), fmt, n, k)
