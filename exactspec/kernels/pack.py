"""Weights into the kernels' layout: (N, K) -> (ceil(N/NL), K, NL) blocks of NL output lanes, float32,
bfloat16 bits, or a quantized format kept quantized (kernels/layout.py), and back (`unpack`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import quant
from .layout import LAYOUTS, NL, QK, record_dtype


@dataclass(frozen=True)
class PackedWeight:
    """A (N, K) weight packed as (ceil(N/NL), K, NL) so each thread task reads one contiguous block.

    `data` is float32, or uint16 holding bfloat16 bits (widened exactly in the kernel), or a
    quantized format kept quantized (`pack_quant`, dequantized in registers): per block and record
    (a group of 32 k's; the K-quants: a super-block of 8 groups), the quants (k-major, lane-minor) then
    the lanes' float16 scales (and minimums); Q8_0 as uint8 (ceil(N/NL), K/32, layout.GROUP_BYTES), the
    other formats as records (ceil(N/NL), K/(32 * groups)) whose one field names the format
    (layout.record_dtype). `bias` is float32 (N,) or an empty array.
    """
    data: np.ndarray
    n: int
    k: int
    bias: np.ndarray

    @property
    def fmt(self) -> str:
        """"f32", "bf16", or the quantized format (quant.FORMATS)."""
        dt = self.data.dtype
        if dt.names:
            return dt.names[0]
        return {np.dtype(np.float32): "f32", np.dtype(np.uint16): "bf16", np.dtype(np.uint8): "q8_0"}[dt]

    @property
    def quantized(self) -> bool:
        return self.fmt in LAYOUTS

    @property
    def int_dot(self) -> bool:
        """Integer-dot layout: the kernel quantizes activations to int8 (kernels/actquant.py)."""
        return self.quantized and LAYOUTS[self.fmt].int_dot

    def quants(self) -> quant.Quantized:
        """The quantized weight (all padded rows), as pack_quant took it."""
        return _unpack_quant(self.data, self.fmt)

    def unpack(self) -> torch.Tensor:
        """(N, K) float32: the weight as the kernel sees it (for references and tests)."""
        d = self.data
        if self.quantized:
            return torch.from_numpy(_unpack_quant(d, self.fmt).dequantize()[: self.n])
        if self.fmt == "bf16":
            d = (d.astype(np.uint32) << 16).view(np.float32)
        return torch.from_numpy(np.ascontiguousarray(d.transpose(0, 2, 1).reshape(-1, self.k)[: self.n]))


def pack_weight(w: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """Pack a (N, K) float32 or bfloat16 tensor. Zero-pads N up to a multiple of NL."""
    n, k = w.shape
    nblk = (n + NL - 1) // NL
    if w.dtype == torch.bfloat16:
        src, dt = w.contiguous().view(torch.int16).numpy().view(np.uint16), np.uint16
    elif w.dtype == torch.float32:
        src, dt = w.contiguous().numpy(), np.float32
    else:
        raise TypeError(f"pack_weight: dtype {w.dtype} (float32 or bfloat16 expected)")
    padded = np.zeros((nblk * NL, k), dt)
    padded[:n] = src
    data = np.ascontiguousarray(padded.reshape(nblk, NL, k).transpose(0, 2, 1))  # (nblk, K, NL)
    b = np.empty(0, np.float32) if bias is None else bias.float().contiguous().numpy().copy()
    return PackedWeight(data, n, k, b)


def _lanes(a: np.ndarray, nblk: int) -> np.ndarray:
    """(n, G) per-row group values -> (nblk, G, NL): zero-padded to nblk*NL rows, lane-minor."""
    p = np.zeros((nblk * NL,) + a.shape[1:], a.dtype)
    p[: a.shape[0]] = a
    return p.reshape(nblk, NL, -1).transpose(0, 2, 1)


def pack_quant(w: quant.Quantized, bias: torch.Tensor | None = None, int_dot: bool = False) -> PackedWeight:
    """Pack a quantized weight kept quantized (LAYOUTS: per record of groups, each group's quants
    k-major and lane-minor, or in the integer-dot order, and its sub-scales; then the record's float16
    scales and minimums). Zero-pads N up to a multiple of NL (scale 0)."""
    n, k = w.shape
    F = LAYOUTS[w.fmt + ("i" if int_dot else "")]
    if k % (QK * F.groups):
        raise ValueError(f"pack_quant: rows of {k} are not whole blocks of {QK * F.groups}")
    nblk, G = (n + NL - 1) // NL, k // QK
    R = G // F.groups
    grp = np.empty((nblk, G, F.group_bytes), np.uint8)  # each group's own bytes
    q = _lanes(w.q.reshape(n, k).view(np.uint8), nblk).reshape(nblk, G, QK, NL)  # (nblk, G, QK, NL)
    if int_dot:  # (nblk, G, quad, lane, k in quad)
        q = q.reshape(nblk, G, QK // 4, 4, NL).transpose(0, 1, 2, 4, 3)
        if F.qbits == 8:
            q = q + np.uint8(128)  # int8 q + 128 as uint8 (wraps: the bits of q + 128 in 0..255)
    if F.nibbles:  # bits 4 (and 5): a plane each, one bit per quant in the layout's order; then the nibbles
        # (a k-row's byte j: lane j low, lane j + 16 high; a quad's 4 bytes of lane j in the same way)
        if F.fields:  # (nblk, G, quad set, quad in set, v, lane in v, k in quad) -> fields, per_byte quads a byte
            f, per = F.fields, F.per_byte
            h = (q >> 4).reshape(nblk, G, QK // 4 // per, per, 2, NL // 2, 4)
            planes = [sum(h[:, :, :, uu] << np.uint8(f * uu) for uu in range(per)).astype(np.uint8).reshape(nblk, G, -1)]
        else:
            planes = [np.packbits((q >> b & 1).reshape(nblk, G, -1), axis=-1, bitorder="little")
                      for b in range(4, F.qbits)]
        lo, hi = (q[..., : NL // 2, :], q[..., NL // 2:, :]) if int_dot else (q[..., : NL // 2], q[..., NL // 2:])
        q = (lo & 15) | ((hi & 15) << 4)
        if planes:
            grp[:, :, F.hb_at: F.sc_at] = np.concatenate(planes, axis=2)
    grp[:, :, :F.hb_at] = q.reshape(nblk, G, F.hb_at)
    if F.sc16:  # (nblk, 2G, NL): the scales of k's 0..15 of a group, then of 16..31
        grp[:, :, F.sc_at:] = _lanes(w.sc.view(np.uint8), nblk).reshape(nblk, G, 2 * NL)
    elif F.sub_scales:
        grp[:, :, F.sc_at: F.mn_at] = _lanes(w.sc, nblk)
        grp[:, :, F.mn_at:] = _lanes(w.mn, nblk)
    data = np.empty((nblk, R, F.record_bytes), np.uint8)
    data[:, :, :F.d_at] = grp.reshape(nblk, R, F.d_at)
    data[:, :, F.d_at: F.m_at] = _lanes(_per_record(w.d, F.groups, "d"), nblk).copy().view(np.uint8).reshape(nblk, R, 2 * NL)
    if F.has_min:
        data[:, :, F.m_at:] = _lanes(_per_record(w.m, F.groups, "dmin"), nblk).copy().view(np.uint8).reshape(nblk, R, 2 * NL)
    if F.nibbles or int_dot:
        data = data.view(record_dtype(F.name))[:, :, 0]
    b = np.empty(0, np.float32) if bias is None else bias.float().contiguous().numpy().copy()
    return PackedWeight(data, n, k, b)


def _per_record(a: np.ndarray, groups: int, what: str) -> np.ndarray:
    """(n, G) per-group values that each record of `groups` groups shares -> (n, G / groups)."""
    r = a[:, ::groups]
    if groups > 1 and not np.array_equal(np.repeat(r, groups, axis=1).view(np.uint16), a.view(np.uint16)):
        raise ValueError(f"pack_quant: a super-block's groups have different {what}")
    return r


def _unpack_quant(data: np.ndarray, fmt: str) -> quant.Quantized:
    """pack_quant's inverse (all nblk*NL rows)."""
    F = LAYOUTS[fmt]
    rec = np.ascontiguousarray(data).view(np.uint8)
    nblk, R = data.shape[:2]
    rec = rec.reshape(nblk, R, F.record_bytes)
    G = R * F.groups
    raw = rec[:, :, :F.d_at].reshape(nblk, G, F.group_bytes)  # each group's own bytes
    if F.int_dot:  # (nblk, G, quad, lane, k in quad), back to (nblk, G, QK, NL) below
        q = raw[:, :, :F.hb_at].reshape(nblk, G, QK // 4, -1, 4)
        q = (q - np.uint8(128)).view(np.int8) if F.qbits == 8 else np.concatenate([q & 15, q >> 4], axis=3)
    else:
        q = raw[:, :, :F.hb_at].reshape(nblk, G, QK, F.row_bytes)
        q = np.concatenate([q & 15, q >> 4], axis=3) if F.nibbles else q.view(np.int8)
    if F.fields:  # bits 4 (and 5) from their fields (layout.py)
        f, per = F.fields, F.per_byte
        x = raw[:, :, F.hb_at: F.sc_at].reshape(nblk, G, QK // 4 // per, 1, 2, NL // 2, 4)
        h = np.concatenate([(x >> np.uint8(f * uu)) & np.uint8((1 << f) - 1) for uu in range(per)], axis=3)
        q = q | (h.reshape(q.shape) << np.uint8(4))
    for b in range(4, F.qbits if F.nibbles and not F.fields else 4):  # the planes of bits 4 (and 5)
        at = F.hb_at + (b - 4) * (QK * NL // 8)
        q = q | (np.unpackbits(raw[:, :, at: at + QK * NL // 8], axis=-1, bitorder="little").reshape(q.shape) << b)
    if F.int_dot:
        q = q.transpose(0, 1, 2, 4, 3).reshape(nblk, G, QK, NL)

    def rows(a):  # (nblk, G, X, NL) -> (nblk*NL, G*X)
        return np.ascontiguousarray(a.transpose(0, 3, 1, 2)).reshape(nblk * NL, -1)

    def shared(at):  # a record's float16 lanes, for each of its groups
        return np.repeat(rec[:, :, at: at + 2 * NL].copy().view(np.float16), F.groups, axis=1)[:, :, None, :]
    d = rows(shared(F.d_at))
    m = rows(shared(F.m_at)) if F.has_min else None
    sc = rows(raw[:, :, None, F.sc_at: F.mn_at]) if F.sub_scales else None
    mn = rows(raw[:, :, None, F.mn_at:]) if F.sub_scales else None
    if F.sc16:
        sc = rows(raw[:, :, F.sc_at:].reshape(nblk, G, 2, NL)).view(np.int8)
    return quant.Quantized(F.base, rows(q), d, m, sc, mn)


def packed_shape(n: int, k: int, layout: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of `PackedWeight.data` for an (n, k) weight in `layout` ("f32", "bf16", or
    a LAYOUTS name), as pack_weight / pack_quant make it."""
    nblk = (n + NL - 1) // NL
    if layout in ("f32", "bf16"):
        return (nblk, k, NL), np.dtype(np.float32 if layout == "f32" else np.uint16)
    if layout == "q8_0":
        return (nblk, k // QK, LAYOUTS["q8_0"].record_bytes), np.dtype(np.uint8)
    return (nblk, k // (QK * LAYOUTS[layout].groups)), record_dtype(layout)
