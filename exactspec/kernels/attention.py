"""Attention of each new row over its own sequence's cache (and `attend_into`, the one row's
arithmetic, shared with the transformers-layout masked attention of exactspec.hf)."""
from __future__ import annotations

import numpy as np
import torch
from numba import get_num_threads, njit, prange, types  # get_num_threads: Python side only
from numba.extending import overload

from .attnvec import QMAX, V, add_values, kv_vector_ok, score_blocks
from .expf import _as_f32, _as_u32, exp32, fma32
from .threads import SERIAL_WORK, TwoBuilds


# ---------------------------------------------------------------------------------------------
# Attention of each new row over its own sequence's cache, which is paged: positions live in
# blocks of BLOCK, a sequence's blocks anywhere in a pool, found through its row of a block table.
# Row r (slot s, position p) attends to keys j in [max(0, p - window + 1), p]: the set and the
# order depend on p alone, never on the cache length, the blocks' places in the pool or the other
# rows. Scores are vectorized across the keys of a block (keys stored transposed, (D, BLOCK) per
# block), each one FMA chain over d in order (s = fma(q[d], k[d, j], s) from +0.0); softmax max is
# exact (-0 taken as +0); the exp sum is 16 partial sums, key j in lane j % 16 ascending, folded by a
# fixed tree; the weighted sum of values (o[d] = fma(e_j, v[j, d], o[d])) runs over j ascending.
# So the bits equal those of one contiguous (D, C) array (one block of C). Which rows and heads share a
# task (attention_tasks) is speed only: each output's chain is the same.
# ---------------------------------------------------------------------------------------------

BLOCK = 16  # positions per KV block: the unit of allocation (and of sharing a prompt prefix)
assert BLOCK == V  # attnvec's score vector is one block's keys
LANES = 16  # the sum of exps: 16 partial sums by key (j % LANES), then a fixed tree (_fold)
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
def attend_into(qv, kk, vv, blocks, j0, n, mrow, scale, o):
    # One query row over logical keys j0 .. j0+n-1 stored in blocks: key j is at block blocks[j // B],
    # offset j % B, of kk (P, D, B) and vv (P, B, D). mrow (j0+n,) uint8 with 1 = attend, or empty
    # = all. Scores an FMA chain over d in order, vectorized across a block's keys; exact max; exp,
    # its sum and the weighted sum of values (FMAs) over keys ascending. Keys the mask excludes are scored but
    # never enter the max, the sum or the output.
    B = kk.shape[2]
    every = mrow.shape[0] == 0
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
                    s[j] = fma32(qd, kv_load(krow[j]), s[j])
        else:  # the ends of the range (or one block of any size: the transformers layout)
            lo = max(j0, b * B)
            hi = min(j0 + n, (b + 1) * B)
            for d in range(qv.shape[0]):
                qd = qv[d]
                krow = kb[d]
                for j in range(lo, hi):
                    sc[j - j0] = fma32(qd, kv_load(krow[j - b * B]), sc[j - j0])
    mx = np.float32(-np.inf)
    for j in range(n):
        sc[j] = sc[j] * scale
        if (every or mrow[j0 + j] != 0) and sc[j] > mx:
            mx = sc[j]
    mx = mx + np.float32(0.0)  # -0 -> +0: the max of a set, whichever of +-0 came first
    o[:] = 0.0
    lanes = np.zeros(LANES, np.float32)  # the sum of exps: lane j % LANES of key j, then _fold
    for b in range(j0 // B, (j0 + n - 1) // B + 1):
        vb = vv[blocks[b]]
        for j in range(max(j0, b * B), min(j0 + n, (b + 1) * B)):
            if every or mrow[j] != 0:
                e = exp32(sc[j - j0] - mx)
                lanes[j % LANES] += e
                vr = vb[j - b * B]
                for d in range(o.shape[0]):
                    o[d] = fma32(e, kv_load(vr[d]), o[d])
    l = _fold(lanes)
    for d in range(o.shape[0]):
        o[d] = o[d] / l


@njit(inline="always")
def _fold(lanes):
    # lanes[0] + ... + lanes[LANES - 1] as a fixed tree: halves added lane-wise (8, 4, 2, 1 apart)
    h = LANES // 2
    while h:
        for i in range(h):
            lanes[i] = lanes[i] + lanes[i + h]
        h //= 2
    return lanes[0]


@njit(inline="always")
def _softmax_span(s, j0, j1, scale, lanes):
    # s: a row of scores whose column c is key c + (a multiple of LANES), keys j0 .. j1 - 1 the span (as
    # columns) -> exp(s * scale - max) in place over the span, 0 in the rest of its LANES-aligned chunks;
    # returns the sum of exps: lane c % LANES of each key, ascending, then _fold; `attend_into`'s bits. The
    # lanes are kept in `lanes` (LANES,) so both loops run over whole chunks (vectorized, no serial chain).
    # Loops index w from 0 (numba's negative-index wraparound would keep loops from a run-time start scalar).
    a0 = j0 - j0 % LANES
    w = s[a0:j1 + (-j1) % LANES]  # whole chunks: w[c] is in lane c % LANES
    n, lo, hi = w.shape[0], j0 - a0, j1 - a0
    for c in range(n):
        w[c] = w[c] * scale if lo <= c < hi else -np.inf
    lanes[:] = -np.inf
    for b in range(n // LANES):  # (a loop that also stored w would not vectorize)
        for i in range(LANES):
            v = w[b * LANES + i]
            lanes[i] = v if v > lanes[i] else lanes[i]
    mx = np.float32(-np.inf)
    for i in range(LANES):  # the max of a set: any order (NaNs never win a comparison)
        mx = lanes[i] if lanes[i] > mx else mx
    mx = mx + np.float32(0.0)
    for c in range(n):
        e = exp32(w[c] - mx)
        w[c] = e if lo <= c < hi else np.float32(0.0)
    lanes[:] = 0.0
    for b in range(n // LANES):
        for i in range(LANES):
            lanes[i] += w[b * LANES + i]
    return _fold(lanes)


@njit(inline="always")
def _attend_group(qb, kk, vv, blocks, j0s, j1s, scale, ob):
    # attend_into without a mask for Q = qb.shape[0] <= QMAX queries of one sequence and one KV head: query i
    # over keys j0s[i] .. j1s[i] - 1, on blocks of BLOCK keys. Each key block and value row is loaded once
    # for all queries (attnvec.py); every value is computed as the scalar loops compute it (tests compare
    # them bitwise): a block's 16 scores as one FMA chain over d per query, the same scale, exact max, exp
    # and sums over keys ascending, values fma(e, v[j, d], o[d]) in chunks of 16 d's.
    Q = qb.shape[0]
    lo, hi = j0s.min(), j1s.max()
    first = lo // BLOCK
    nblk = (hi - 1) // BLOCK - first + 1
    base = first * BLOCK  # the key of sc's column 0
    sc = np.empty((Q, nblk * BLOCK), np.float32)
    score_blocks(qb, kk, blocks, first, nblk, sc)  # keys outside a query's span are scored, never used
    ls = np.empty(Q + LANES, np.float32)  # the queries' sums, then room for _softmax_span's lanes
    for i in range(Q):
        ls[i] = _softmax_span(sc[i], j0s[i] - base, j1s[i] - base, scale, ls[Q:])
    ob[:] = 0.0
    s0, s1 = j0s.max(), j1s.min()  # the keys every query attends: one pass for all
    if s0 >= s1:
        s0 = s1 = hi
    for i in range(Q):  # keys ascending per query: its own before the shared span, the shared, its own after
        add_values(ob[i], sc[i], base, vv, blocks, j0s[i], min(s0, j1s[i]))
    add_values(ob, sc, base, vv, blocks, s0, s1)
    for i in range(Q):
        add_values(ob[i], sc[i], base, vv, blocks, max(s1, j0s[i]), j1s[i])
    for i in range(Q):
        for d in range(ob.shape[1]):
            ob[i, d] = ob[i, d] / ls[i]


def _vector_group(kk, vv, D) -> bool:
    """Can _attend_group run on these cache arrays (C-contiguous float32 or bfloat16, D a multiple of 16)?"""


@overload(_vector_group, inline="always")
def _vector_group_impl(kk, vv, D):
    if not (kv_vector_ok(kk) and kv_vector_ok(vv)):
        return lambda kk, vv, D: False
    return lambda kk, vv, D: kk.shape[2] == BLOCK and D % V == 0


@njit(inline="always")
def attention_tasks(slot, pos, Hq, Hkv, threads):
    """(T, 4) int64 tasks (first row, rows, first query head, heads): rows of one sequence at consecutive
    positions and query heads of one KV head, at most QMAX queries a task, so each key block and value row is
    read once for them all. One query head a task where that would leave threads idle (a lone row of a
    model with few KV heads; threads: the pool's size). Speed only: no output depends on the tasks."""
    R = slot.shape[0]
    gs = Hq // Hkv
    nh = 1 if R * Hkv < threads else min(gs, QMAX)
    nr = max(1, QMAX // nh)
    starts = np.empty(R + 1, np.int64)
    ng = 0
    for r in range(R):
        if r == 0 or slot[r] != slot[r - 1] or pos[r] != pos[r - 1] + 1 or r - starts[ng - 1] >= nr:
            starts[ng] = r
            ng += 1
    starts[ng] = R
    per = -(-gs // nh)
    tasks = np.empty((ng * Hkv * per, 4), np.int64)
    t = 0
    for i in range(ng):
        for g in range(Hkv):
            for h in range(0, gs, nh):  # a KV head's query heads, nh at a time (the last chunk may be short)
                tasks[t, 0], tasks[t, 1] = starts[i], starts[i + 1] - starts[i]
                tasks[t, 2], tasks[t, 3] = g * gs + h, min(nh, gs - h)
                t += 1
    return tasks


@njit(cache=True, nogil=True)
def attend_task(task, q, kt, v, table, slot, pos, scale, window, out):
    # A task of attention_tasks: rows r0 .. r0+nr-1 (one slot) x query heads h0 .. h0+nh-1 (one KV head g).
    r0, nr, h0, nh = task[0], task[1], task[2], task[3]
    Hq, D = q.shape[1], q.shape[2]
    g = h0 // (Hq // kt.shape[0])
    blocks = table[slot[r0]]
    Q = nr * nh
    j0s = np.empty(Q, np.int64)
    j1s = np.empty(Q, np.int64)
    for i in range(Q):
        p = pos[r0 + i // nh]
        j0s[i] = p - window + 1 if window > 0 and p - window + 1 > 0 else 0
        j1s[i] = p + 1
    if _vector_group(kt[g], v[g], D):
        qb = np.empty((Q, D), np.float32)
        ob = np.empty((Q, D), np.float32)
        for i in range(Q):
            qb[i] = q[r0 + i // nh, h0 + i % nh]
        _attend_group(qb, kt[g], v[g], blocks, j0s, j1s, scale, ob)
        for i in range(Q):
            out[r0 + i // nh, h0 + i % nh] = ob[i]
    else:
        for i in range(Q):
            attend_into(q[r0 + i // nh, h0 + i % nh], kt[g], v[g], blocks, j0s[i], j1s[i] - j0s[i], _ALL, scale,
                    out[r0 + i // nh, h0 + i % nh])


@njit(parallel=True, cache=True, nogil=True)
def _attention(q, kt, v, table, slot, pos, scale, window, out, threads):
    tasks = attention_tasks(slot, pos, q.shape[1], kt.shape[0], threads)
    for t in prange(tasks.shape[0]):
        attend_task(tasks[t], q, kt, v, table, slot, pos, scale, window, out)
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
                       pos.numpy(), np.float32(scale), window, out.numpy(), get_num_threads())
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
