"""GGUF block-quantized weights kept quantized: Q8_0, Q4_0 and Q4_1 (32 weights per block).

A `Quantized` holds an (n, k) weight split into per-weight quants and per-block float16 scales (and
Q4_1's minimums), rows in our order. `dequantize` is the one definition of each weight's value,
equal to the gguf package's (llama.cpp's) dequantization to the bit, and the linear kernel
computes it the same way in registers (tile.py):
    Q8_0: f32(d) * f32(q), q int8            (exact: 11 + 8 significant bits fit in float32)
    Q4_0: f32(d) * f32(q - 8), q in 0..15    (exact)
    Q4_1: f32(d) * f32(q) + f32(m)           (d * q exact, so one rounding, fused or not)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import UnsupportedModelError

QK = 32  # weights per block (and per group of the packed kernel layout)
FORMATS = ("q8_0", "q4_0", "q4_1")
# bytes of one GGUF block: float16 d, (float16 m), then the quants
_BLOCK = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


@dataclass(frozen=True)
class Quantized:
    fmt: str  # one of FORMATS
    q: np.ndarray  # (n, k): int8 (q8_0) or uint8 0..15 (q4_0, q4_1)
    d: np.ndarray  # (n, k/32) float16
    m: np.ndarray | None = None  # (n, k/32) float16, q4_1 only

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def rows(self, f) -> "Quantized":
        """The same tensor with f applied to the row axis of q, d and m (a permutation)."""
        return Quantized(self.fmt, f(self.q), f(self.d), None if self.m is None else f(self.m))

    def dequantize(self) -> np.ndarray:
        """(n, k) float32: each weight's value, as defined above."""
        n, k = self.q.shape
        q = self.q.reshape(n, k // QK, QK)
        d = self.d.astype(np.float32)[:, :, None]
        if self.fmt == "q8_0":
            w = q.astype(np.float32) * d
        elif self.fmt == "q4_0":
            w = (q.astype(np.int8) - np.int8(8)).astype(np.float32) * d
        else:
            w = q.astype(np.float32) * d + self.m.astype(np.float32)[:, :, None]
        return w.reshape(n, k)


def concat(parts: list[Quantized]) -> Quantized:
    """Row-wise concatenation of tensors of one format."""
    fmt = parts[0].fmt
    assert all(p.fmt == fmt for p in parts)
    return Quantized(fmt, np.concatenate([p.q for p in parts]), np.concatenate([p.d for p in parts]),
                     None if fmt != "q4_1" else np.concatenate([p.m for p in parts]))


def from_blocks(raw: np.ndarray, fmt: str, n: int, k: int) -> Quantized:
    """GGUF blocks (uint8, as stored) of an (n, k) tensor -> Quantized."""
    blocks = np.asarray(raw).view(np.uint8).reshape(n, k // QK, _BLOCK[fmt])
    d = blocks[:, :, :2].copy().view(np.float16).reshape(n, k // QK)
    if fmt == "q8_0":
        return Quantized(fmt, blocks[:, :, 2:].copy().view(np.int8).reshape(n, k), d)
    m = blocks[:, :, 2:4].copy().view(np.float16).reshape(n, k // QK) if fmt == "q4_1" else None
    qs = blocks[:, :, -QK // 2:]  # byte i: weight i in the low nibble, weight i + 16 in the high one
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, k)
    return Quantized(fmt, q, d, m)


def quantize(w: np.ndarray, fmt: str, name: str = "weight") -> Quantized:
    """Quantize an (n, k) float array with the gguf package (llama.cpp's rounding)."""
    import gguf
    n, k = w.shape
    if k % QK:
        raise UnsupportedModelError(f"quantize={fmt!r}: {name} has rows of {k} values, not whole blocks of {QK}")
    t = getattr(gguf.GGMLQuantizationType, fmt.upper())
    return from_blocks(gguf.quants.quantize(np.ascontiguousarray(w, np.float32), t), fmt, n, k)
