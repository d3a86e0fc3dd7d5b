"""Attention of each new row over its own sequence's cache (and `_attend`, the one row's
arithmetic, shared with the transformers-layout masked attention of exactspec.hf)."""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from .attnvec import G, V, add_values, kv_vector_ok, score_blocks
from .expf import _as_f32, _as_u32, exp32
from .threads import SERIAL_WORK, TwoBuilds


# ---------------------------------------------------------------------------------------------
# Attention of each new row over its own sequence's cache, which is paged: positions live in
# blocks of BLOCK, a sequence's blocks anywhere in a pool, found through its row of a block table.
# Row r (slot s, position p) attends to keys j in [max(0, p - window + 1), p]: the set and the
# order depend on p alone, never on the cache length, the blocks' places in the pool or the other
# rows. Scores are vectorized across the keys of a block (keys stored transposed, (D, BLOCK) per
# block), each summed over d in order; softmax max is exact; exp sum and the weighted sum of values
# run over j ascending. So the bits equal those of one contiguous (D, C) array (one block of C).
# ---------------------------------------------------------------------------------------------

BLOCK = 16  # positions per KV block: the unit of allocation (and of sharing a prompt prefix)
assert BLOCK == V  # attnvec's score vector is one block's keys
_ALL = np.empty(0, np.uint8)  # "no mask": every key in the range is attended


# ---------------------------------------------------------------------------------------------
# The stored key/value type: float32, or bfloat16 kept as uint16 bits (kv_dtype="bfloat16", half
# the memory and reads). A bfloat16 entry is its float32 value rounded once when written (to
# nearest, ties to even, as torch's .to(bfloat16)), so a position's stored keys are still a function
# of its prefix alone; reading widens it exactly (the bits shifted into a float32's top half).
# ---------------------------------------------------------------------------------------------

def kv_load(x):
    """A stored key/value entry as float32 (the twin of the compiled overload below)."""
    return np.float32(x) if not isinstance(x, np.uint16) else \
        np.array([np.uint32(x) << 16], np.uint32).view(np.float32)[0]


def kv_store(x, dest):
    """float32 x as an entry of the array `dest` (float32, or uint16 bfloat16 bits)."""
    if dest.dtype != np.uint16:
        return np.float32(x)
    return np.uint16(torch.tensor([float(x)]).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF)


@overload(kv_load, inline="always")
def _kv_load(x):
    if x == types.uint16:
        return lambda x: _as_f32(np.uint32(x) << np.uint32(16))
    return lambda x: x


@overload(kv_store, inline="always")
def _kv_store(x, dest):
    if dest.dtype == types.uint16:
        def bf16(x, dest):
            b = _as_u32(x)
            if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: kept a (quiet) NaN
                return np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
            return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return bf16
    return lambda x, dest: x


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as the kernels take it: float32 as is, bfloat16 (a KV cache, an embedding) as its bits in uint16."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


@njit(inline="always")
def _attend(qv, kk, vv, blocks, j0, n, mrow, scale, o):
    # One query row over logical keys j0 .. j0+n-1 stored in blocks: key j is at block blocks[j // B],
    # offset j % B, of kk (P, D, B) and vv (P, B, D). mrow (j0+n,) uint8 with 1 = attend, or empty
    # = all. Scores summed over d in order, vectorized across a block's keys; exact max; exp, its
    # sum and the weighted sum of values over keys ascending. Keys the mask excludes are scored but
    # never enter the max, the sum or the output.
    B = kk.shape[2]
    every = mrow.shape[0] == 0
    if B == BLOCK and every and qv.shape[0] % V == 0 and _vector_attend(qv, kk, vv, blocks, j0, n, scale, o):
        return  # the same operations, as vector code (attnvec.py)
    sc = np.zeros(n, np.float32)
    for b in range(j0 // B, (j0 + n - 1) // B + 1):
        kb = kk[blocks[b]]
        base = b * B - j0  # the block's first key, as an index of sc
        if B == BLOCK and base >= 0 and base + BLOCK <= n:  # a whole block: a constant trip count, vectorized
            s = sc[base:base + BLOCK]
            for d in range(qv.shape[0]):
                qd = qv[d]
                krow = kb[d]
                for j in range(BLOCK):
                    s[j] += qd * kv_load(krow[j])
        else:  # the ends of the range (or one block of any size: the transformers layout)
            lo = max(j0, b * B)
            hi = min(j0 + n, (b + 1) * B)
            for d in range(qv.shape[0]):
                qd = qv[d]
                krow = kb[d]
                for j in range(lo, hi):
                    sc[j - j0] += qd * kv_load(krow[j - b * B])
    mx = np.float32(-np.inf)
    for j in range(n):
        sc[j] = sc[j] * scale
        if (every or mrow[j0 + j] != 0) and sc[j] > mx:
            mx = sc[j]
    o[:] = 0.0
    l = np.float32(0.0)
    for b in range(j0 // B, (j0 + n - 1) // B + 1):
        vb = vv[blocks[b]]
        for j in range(max(j0, b * B), min(j0 + n, (b + 1) * B)):
            if every or mrow[j] != 0:
                e = exp32(sc[j - j0] - mx)
                l += e
                vr = vb[j - b * B]
                for d in range(o.shape[0]):
                    o[d] += e * kv_load(vr[d])
    for d in range(o.shape[0]):
        o[d] = o[d] / l


@njit(inline="always")
def _attend_blocks(qv, kk, vv, blocks, j0, n, scale, o):
    # _attend without a mask, on blocks of BLOCK keys: each block's 16 scores as one vector chain over d,
    # then the same scale, exact max, exp and sums over keys ascending; values o[d] + e * v[j, d] in
    # chunks of 16 d's. Every value as the scalar loops compute it (tests compare them bitwise).
    first = j0 // BLOCK
    nblk = (j0 + n - 1) // BLOCK - first + 1
    sc = np.empty(nblk * BLOCK, np.float32)
    for i in range(0, nblk, G):
        score_blocks(qv, kk, blocks, first + i, nblk - i, sc[i * BLOCK:])
    s = sc[j0 - first * BLOCK:]  # key j0's score first (loops from 0: no index wraparound, they vectorize)
    mx = np.float32(-np.inf)
    for j in range(n):
        v = s[j] * scale
        s[j] = v
        if v > mx:
            mx = v
    for j in range(n):  # a map: vectorized (exp32's bits do not depend on the lane)
        s[j] = exp32(s[j] - mx)
    l = np.float32(0.0)
    for j in range(n):
        l += s[j]
    o[:] = 0.0
    add_values(o, s, vv, blocks, j0, j0 + n)
    for d in range(o.shape[0]):
        o[d] = o[d] / l


def _vector_attend(qv, kk, vv, blocks, j0, n, scale, o) -> bool:
    """_attend_blocks where the cache arrays are C-contiguous (else False: the scalar loops run)."""


@overload(_vector_attend, inline="always")
def _vector_attend_impl(qv, kk, vv, blocks, j0, n, scale, o):
    if not (kv_vector_ok(kk) and kv_vector_ok(vv)):
        return lambda qv, kk, vv, blocks, j0, n, scale, o: False

    def run(qv, kk, vv, blocks, j0, n, scale, o):
        _attend_blocks(qv, kk, vv, blocks, j0, n, scale, o)
        return True
    return run


@njit(inline="always")
def _attend_task(t, q, kt, v, table, slot, pos, scale, window, out):
    # Task t = (row r, query head h): row r at position p of slot s over its keys j0..p.
    Hq = q.shape[1]
    r = t // Hq
    h = t % Hq
    s = slot[r]
    p = pos[r]
    j0 = 0
    if window > 0 and p - window + 1 > 0:
        j0 = p - window + 1
    g = h // (Hq // kt.shape[0])
    _attend(q[r, h], kt[g], v[g], table[s], j0, p + 1 - j0, _ALL, scale, out[r, h])


@njit(parallel=True, cache=True, nogil=True)
def _attention(q, kt, v, table, slot, pos, scale, window, out):
    for t in prange(q.shape[0] * q.shape[1]):
        _attend_task(t, q, kt, v, table, slot, pos, scale, window, out)
    return out


_ATTENTION = TwoBuilds(_attention)


def attention(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, table: np.ndarray, slot: torch.Tensor,
              pos: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q (R, Hq, D); kt (Hkv, P, D, B); v (Hkv, P, B, D) float32 or bfloat16; table (S, NB) int32 (a
    slot's blocks); slot, pos (R,) int64 -> (R, Hq, D)."""
    out = torch.empty_like(q)
    if q.shape[0]:
        R, Hq, D = q.shape
        work = R * Hq * D * (int(pos.max()) + 1) * 2
        _ATTENTION.run(work, SERIAL_WORK, q.contiguous().numpy(), as_numpy(kt), as_numpy(v), table, slot.numpy(),
                       pos.numpy(), np.float32(scale), window, out.numpy())
    return out


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """One sequence, float64: q (T, Hq, D) at positions 0..T-1, k/v (T, Hkv, D)."""
    T, Hq, D = q.shape
    grp = Hq // k.shape[1]
    k = k.double().repeat_interleave(grp, dim=1)
    v = v.double().repeat_interleave(grp, dim=1)
    s = torch.einsum("thd,jhd->htj", q.double(), k) * scale
    i = torch.arange(T)
    mask = i[None, :] > i[:, None]
    if window > 0:
        mask |= i[None, :] <= i[:, None] - window
    s = s.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("htj,jhd->thd", s, v).float()
