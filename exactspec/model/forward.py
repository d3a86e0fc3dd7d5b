"""The whole transformer forward as one compiled call (numba), on stacked per-layer weights.

Contract: `forward(...)` returns bitwise the logits of `Transformer.forward_ref` (the readable
forward in transformer.py, one kernel call per step): every step here is the same helper from
kernels/ (rows.py, linear.py, tile.py, attention.py) with the same operands in the same order; fusing only removes the calls,
the torch<->numpy glue and the allocations between them. Two fusions change where, not how, a value
is computed:
* o-proj and down-proj add the residual in their store (x + (chain + bias), as `x + linear(a)`);
* gate/up blocks are interleaved (gate block c, then up block c) so one task has both halves of
  intermediate columns c*NL .. c*NL+NL-1 and stores silu(g) * u with `silu_mul`'s expression
  (`kernels.linear.linear_block`, mode SWIGLU).
Gemma 3 (cfg.post_norms) stores o-proj and down-proj apart instead, RMS-norms them, then adds them
to the residual (as `x + rmsnorm(linear(a))`); its windowed layers read their own RoPE table.
A mixture of experts (Qwen3-MoE) routes each row (kernels/moe.py), runs each expert on the rows that
chose it (a row's bits do not depend on which other rows share the call: every kernel is row-invariant),
and adds each row's expert outputs times their weights to zero in expert-index order, then to the
residual (`_experts`, as `Transformer._experts_ref`).
Threads (prange) split output blocks of each linear and (row, head) pairs of attention, never one
reduction, so the result does not depend on the thread count; the serial build (small calls)
compiles the same source.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.extending import overload

from ..kernels.attention import attend_task, attention_tasks
from ..kernels.layout import LAYOUTS, NL, QK
from ..kernels.actquant import act_buffers, acts
from ..kernels.linear import ADD, STORE, SWIGLU, block
from ..kernels.moe import route_into
from ..kernels.pack import PackedWeight
from ..kernels.rows import qkv_rope_cache_into, rmsnorm_into
from ..kernels.threads import TwoBuilds
from .stack import Stack


def _embed(table, tokens, x):
    """x[r] = table[tokens[r]] widened to float32 (table float32, or uint16 holding bfloat16 bits, or a
    quantized packed weight's records (nblk, R, record bytes), see kernels.pack_quant): row t is
    lane t % NL of block t // NL)."""


_POW2 = np.array([2.0 ** (i - 40) for i in range(64)], np.float32)  # exact powers of two


@njit(inline="always")
def _f16(lo, hi):
    """float16 bits (two bytes) -> float32, exactly: (1024 + m) * 2^(e-25), or m * 2^-24 subnormal."""
    h = np.int64(lo) | (np.int64(hi) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = np.float32(m) * _POW2[40 - 24]
    elif e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(1024 + m) * _POW2[e - 25 + 40]
    return -v if h & 0x8000 else v


@overload(_embed)
def _embed_impl(table, tokens, x):
    # A quantized layout (kernels/layout.py): records named by the layout, or plain uint8 for Q8_0's
    # float layout. Each weight with kernels/quant.py's expression.
    if isinstance(table.dtype, types.Record) or table.dtype == types.uint8:
        name = next(iter(table.dtype.fields)) if isinstance(table.dtype, types.Record) else "q8_0"
        F = LAYOUTS[name]
        int_dot, bits, has_min, k_quant, sc16 = F.int_dot, F.qbits, F.has_min, F.sub_scales, F.sc16
        fw, per = F.fields, F.per_byte  # high-bit fields (5-, 6-bit integer-dot layouts)
        HB, D, M, SC, MN, PLANE = F.hb_at, F.d_at, F.m_at, F.sc_at, F.mn_at, QK * NL // 8
        GROUPS, GB = F.groups, F.group_bytes
        off = F.zero
        record = isinstance(table.dtype, types.Record)

        def quant_rows(table, tokens, x):
            for r in range(tokens.shape[0]):
                b, j = tokens[r] // NL, tokens[r] % NL
                for g in range(table.shape[1] * GROUPS):
                    rec = table[b, g // GROUPS][name] if record else table[b, g]
                    grp = rec[(g % GROUPS) * GB:]  # the group's own bytes; d and m are the record's
                    d = _f16(rec[D + 2 * j], rec[D + 2 * j + 1])
                    m = _f16(rec[M + 2 * j], rec[M + 2 * j + 1]) if has_min else np.float32(0)
                    if k_quant:  # d * sc and -(dmin * mn): exact
                        d = d * np.float32(grp[SC + j])
                        m = -(m * np.float32(grp[MN + j]))
                    for kk in range(QK):
                        if bits == 8:
                            q = np.int32(grp[(kk // 4) * 128 + 4 * j + kk % 4]) - off if int_dot else np.int32(grp[kk * NL + j])
                            if not int_dot and q > 127:
                                q -= 256
                            x[r, g * QK + kk] = np.float32(q) * d
                            continue
                        at = (kk // 4) * 64 + 4 * (j % (NL // 2)) + kk % 4 if int_dot else kk * (NL // 2) + j % (NL // 2)
                        byte = np.int32(grp[at])
                        q = byte >> 4 if j >= NL // 2 else byte & 15
                        i = (kk // 4) * 128 + 64 * (j // (NL // 2)) + 4 * (j % (NL // 2)) + kk % 4 if int_dot else kk * NL + j
                        if fw:  # bit 4 (and 5): a field (layout.py)
                            u = kk // 4
                            at = HB + ((u // per) * 2 + j // (NL // 2)) * 64 + 4 * (j % (NL // 2)) + kk % 4
                            q |= ((np.int32(grp[at]) >> (fw * (u % per))) & ((1 << fw) - 1)) << 4
                        for bit in range(4, 4 if fw else bits):  # bits 4 (and 5): their planes (layout.py)
                            at = HB + (bit - 4) * PLANE + i // 8
                            q |= ((np.int32(grp[at]) >> (i % 8)) & 1) << bit
                        if sc16:  # (d * sc) * (q - 32), sc int8 of the group's half
                            sc = np.int32(grp[SC + (kk // (QK // 2)) * NL + j])
                            x[r, g * QK + kk] = (d * np.float32(sc - 256 if sc > 127 else sc)) * np.float32(q - off)
                        else:
                            x[r, g * QK + kk] = np.float32(q) * d + m if has_min else np.float32(q - off) * d
        return quant_rows

    if table.dtype == types.uint16:
        def widen(table, tokens, x):
            bits = x.view(np.uint32)  # bfloat16 -> float32 is exact: the bf16 bits are the top half
            for r in range(tokens.shape[0]):
                row = table[tokens[r]]
                for i in range(row.shape[0]):
                    bits[r, i] = np.uint32(row[i]) << 16
        return widen

    def copy(table, tokens, x):
        for r in range(tokens.shape[0]):
            x[r] = table[tokens[r]]
    return copy


@njit(cache=True, nogil=True)
def _embed_rows(table, tokens, x):
    _embed(table, tokens, x)
    return x


def embed_rows(table: np.ndarray, tokens: np.ndarray, H: int) -> np.ndarray:
    """(R, H) float32: the rows the compiled forward starts from (for forward_ref and tests)."""
    return _embed_rows(table, tokens, np.empty((tokens.shape[0], H), np.float32))


@njit(inline="always")
def _blocks_at(w, i):
    # Output blocks of layer i's weight of a Stack kind w = (a, alt, sel) (see _linear_at).
    a, alt, sel = w
    s = sel[i]
    return a.shape[1] if s >= 0 else alt.shape[1]


@njit(inline="always")
def _linear_at(xa, w, i, bias, y, b, mode):
    # Block b of layer i's weight of a Stack kind w = (a, alt, sel): a[sel[i]] if sel[i] >= 0, else
    # alt[-1 - sel[i]] (a kind's two formats). linear_block is a function of its own, compiled once per
    # weight type: one format's two branches share it.
    a, alt, sel = w
    s = sel[i]
    if s >= 0:
        block(xa, a[s], bias, y, b, mode)
    else:
        block(xa, alt[-1 - s], bias, y, b, mode)


@njit(parallel=True, cache=True, nogil=True)
def _linear_layer(xa, w, i, bias, y, mode):
    # Every output block of layer i's weight of kind w (SWIGLU: gate/up pairs), split over the threads.
    # A parallel kernel of its own, compiled once per weight type for every kind and model (as a
    # parallel loop in _forward, each of its five was lowered again: a third of its compile time).
    n = _blocks_at(w, i)
    if mode >= SWIGLU:
        n = n // 2
    for b in prange(n):
        _linear_at(xa, w, i, bias, y, b, mode)


_LINEAR_LAYER = TwoBuilds(_linear_layer)


@njit(parallel=True, cache=True, nogil=True)
def _forward(rows, top, layers, dims, cache, logits, hidden):
    # rows: tokens, slot, pos (R,) int64, out_rows (n,) int64 and x_in (R, H) float32 or (0, H): the
    # rows to start from instead of the tokens' embeddings (a drafting head's inputs) -> logits (n, V)
    # float32; hidden (R, H) or (0, H): every row's final-normed hidden state, when asked (a drafting
    # head reads the target's). Neither changes a logit.
    # top: embed, final norm, head; layers: the Stack's arrays (a leading layer axis each; each linear
    # kind as (a, alt, sel), see Stack); dims: heads, kv heads, head dim, I (the intermediate size: the
    # packed weights' shapes do not show it, a Q8_0 weight's second axis counts groups of 32), the
    # outputs of wqkv (all of q, k, v unless v is apart: wv), eps, scale, window, threads (the pool's size:
    # how attention's tasks are cut, speed only), the gated MLP's mode (SWIGLU or GEGLU), the embedding's
    # scale (0: none), each layer's window (L,) (0: none) and RoPE table (L,); cache: the RoPE tables
    # (T, C, D) each, the global layers' block table (S, NB) and paged K/V pools, the sliding-window
    # layers' (their local pools, cache.py) and each layer's index in its pool (L,). A mixture of experts: dims ends with
    # their count E (0: a dense MLP), how many a row takes and whether their weights are normalized;
    # wgu and wdown hold layer i's expert e at i * E + e, wr the routers.
    tokens, slot, pos, out_rows, x_in = rows
    embed, norm, head = top
    (attn_norm, wqkv, bqkv, wv, bv, q_norm, k_norm, wo, bo, mlp_norm, wgu, bgu, wdown, bdown, post_attn,
     post_mlp, wr, br) = layers
    Hq, Hkv, D, I, nqk, eps, scale, threads, gated, embed_scale, windows, rope_of, E, k_used, norm_topk = dims
    cos, sin, gtable, gk, gv, ltable, lk, lv, kv_at = cache
    R = tokens.shape[0]
    H = norm.shape[0]
    x = np.empty((R, H), np.float32)  # the residual stream
    if x_in.shape[0]:
        x[:] = x_in
    else:
        _embed(embed, tokens, x)
        if embed_scale != 0:
            for r in range(R):
                for c in range(H):
                    x[r, c] = x[r, c] * embed_scale
    post = post_attn.shape[1] > 0
    o = np.empty((R, H) if post or E else (0, H), np.float32)  # Gemma: o-proj / down-proj apart, then normed
    L = attn_norm.shape[0]
    nqkv = (Hq + 2 * Hkv) * D
    h = np.empty((R, H), np.float32)
    qkv = np.empty((R, nqkv), np.float32)
    q = np.empty((R, Hq, D), np.float32)
    a = np.empty((R, Hq * D), np.float32)
    a3 = a.reshape((R, Hq, D))  # the same memory, per head
    act = np.empty((R, I), np.float32)
    ab = act_buffers(R, max(H, Hq * D, I))  # int8 rows for integer-dot layouts, reused by every linear
    tasks = attention_tasks(slot, pos, Hq, Hkv, threads)
    store, add = np.int64(STORE), np.int64(ADD)  # plain int64s: one _linear_layer build for every mode
    for i in range(L):  # acts: each linear's input as its tile takes it (int8 rows for integer-dot layouts)
        rmsnorm_into(x, attn_norm[i], eps, h)
        ha = acts(h, wqkv[0], ab)  # (wv, when apart, is quantized as wqkv is: the same rows serve)
        _linear_layer(ha, wqkv, i, bqkv[i], qkv[:, :nqk], store)
        if wv[2].shape[0] > 0:
            _linear_layer(ha, wv, i, bv[i], qkv[:, nqk:], store)
        t_i, j = rope_of[i], kv_at[i]
        if windows[i] > 0:  # a sliding-window layer's keys: the local pool's (cache.py)
            table, kc, vc = ltable, lk[j], lv[j]
        else:
            table, kc, vc = gtable, gk[j], gv[j]
        qkv_rope_cache_into(qkv, Hq, Hkv, D, q_norm[i], k_norm[i], eps, cos[t_i], sin[t_i], table, slot, pos, kc,
                            vc, q)
        window = windows[i]
        for t in prange(tasks.shape[0]):
            attend_task(tasks[t], q, kc, vc, table, slot, pos, scale, window, a3)
        if post:
            _linear_layer(acts(a, wo[0], ab), wo, i, bo[i], o, store)
            _add_normed(x, o, post_attn[i], eps)
        else:
            _linear_layer(acts(a, wo[0], ab), wo, i, bo[i], x, add)
        rmsnorm_into(x, mlp_norm[i], eps, h)
        if E:
            _experts(h, wr, br, wgu, bgu, wdown, bdown, i, E, k_used, norm_topk, gated, I, ab, o)
            if post:
                _add_normed(x, o, post_mlp[i], eps)
            else:
                _add(x, o)
            continue
        _linear_layer(acts(h, wgu[0], ab), wgu, i, bgu[i], act, gated)
        if post:
            _linear_layer(acts(act, wdown[0], ab), wdown, i, bdown[i], o, store)
            _add_normed(x, o, post_mlp[i], eps)
        else:
            _linear_layer(acts(act, wdown[0], ab), wdown, i, bdown[i], x, add)
    n = out_rows.shape[0]
    hf = np.empty((n, H), np.float32)
    xs = np.empty((n, H), np.float32)
    for r in range(n):
        xs[r] = x[out_rows[r]]
    rmsnorm_into(xs, norm, eps, hf)
    if hidden.shape[0]:
        rmsnorm_into(x, norm, eps, hidden)
    hfa = acts(hf, head, ab)
    for b in prange(head.shape[0]):
        block(hfa, head, bqkv[0][:0], logits, b, STORE)  # (an empty bias of the layers' type)
    return logits


@njit(inline="always")
def _add(x, o):
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            x[r, c] = x[r, c] + o[r, c]


@njit(inline="always")
def _add_normed(x, o, w, eps):
    # x += rmsnorm(o) * w, row by row (o normed in place: rmsnorm's row writes y[i] after reading x[i])
    rmsnorm_into(o, w, eps, o)
    _add(x, o)


@njit(inline="always")
def _experts(h, wr, br, wgu, bgu, wdown, bdown, i, E, k, norm_topk, gated, I, ab, y):
    # Layer i's mixture of experts on the normed rows h -> y: the router's logits, each row's top k
    # (route_into), then expert by expert in index order: its rows gathered, its gated MLP, and
    # y[r] += out * weight for each of them (y from zero: each row's sum in expert-index order).
    R, H = h.shape
    logits = np.empty((R, E), np.float32)
    _linear_layer(acts(h, wr[0], ab), wr, i, br[i], logits, np.int64(STORE))
    idx = np.empty((R, k), np.int64)
    wts = np.empty((R, k), np.float32)
    route_into(logits, k, norm_topk, idx, wts)
    y[:] = 0.0
    rows = np.empty(R, np.int64)
    rw = np.empty(R, np.float32)
    for e in range(E):
        n = 0
        for r in range(R):
            for j in range(k):
                if idx[r, j] == e:
                    rows[n] = r
                    rw[n] = wts[r, j]
                    n += 1
        if n == 0:
            continue
        he = np.empty((n, H), np.float32)
        for j in range(n):
            he[j] = h[rows[j]]
        u = i * E + e
        act = np.empty((n, I), np.float32)
        _linear_layer(acts(he, wgu[0], ab), wgu, u, bgu[u], act, gated)
        out = np.empty((n, H), np.float32)
        _linear_layer(acts(act, wdown[0], ab), wdown, u, bdown[u], out, np.int64(STORE))
        for j in range(n):
            r = rows[j]
            for c in range(H):
                y[r, c] = y[r, c] + out[j, c] * rw[j]


_FORWARD = TwoBuilds(_forward, calls={"_linear_layer": _LINEAR_LAYER})
SERIAL_FORWARD = 1 << 19  # multiply-adds per forward below which one thread runs it all (~50 us)


class Weights(NamedTuple):
    """What a forward reads of the model: the stacked layers, the embedding table ((V, H) float32 or
    uint16 bf16 bits, or a packed quantized table), the final norm, the head, RoPE's tables (T, C, D)."""
    stack: Stack
    embed: np.ndarray
    norm: np.ndarray
    head: PackedWeight
    cos: np.ndarray
    sin: np.ndarray


class Shape(NamedTuple):
    """The attention's shape: query heads, KV heads, head size, RMS epsilon, score scale, each layer's
    sliding window (L,) int64 (0: none) and RoPE table (L,) int64 (an index into Weights.cos/sin); the gated
    MLP's mode (linear.SWIGLU or GEGLU), the embedding's scale (0: none); a mixture of experts': their
    count (0: none), how many each row takes, whether their weights are divided by their sum."""
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    windows: np.ndarray
    rope_of: np.ndarray
    gated: int = SWIGLU
    embed_scale: float = 0.0
    experts: int = 0
    experts_used: int = 0
    norm_topk: bool = False


class RowSet(NamedTuple):
    """The rows of one forward: tokens, slot and position of each (R,) int64 (checked by the caller),
    and the rows whose logits are wanted (n,) int64."""
    tokens: np.ndarray
    slot: np.ndarray
    pos: np.ndarray
    out_rows: np.ndarray


class CacheView(NamedTuple):
    """The paged KV cache as the kernels read it (cache.py): the global layers' block table and key and
    value pools, the sliding-window layers' (local) ones, and each layer's index in its pool (L,)."""
    table: np.ndarray
    k: np.ndarray
    v: np.ndarray
    local_table: np.ndarray
    local_k: np.ndarray
    local_v: np.ndarray
    at: np.ndarray


def forward(w: Weights, shape: Shape, rows: RowSet, cache: CacheView, x_in: np.ndarray | None = None,
            hidden: np.ndarray | None = None) -> np.ndarray:
    """Logits (n, V) float32 of `rows.out_rows`, writing every row's keys and values into `cache`.
    x_in (R, H) float32: the rows to start from in place of the tokens' embeddings; hidden (R, H)
    float32: filled with every row's final-normed state."""
    st, embed, norm, head, cos, sin = w
    Hq, Hkv, D, eps, scale, windows, rope_of, gated, embed_scale, E, k_used, norm_topk = shape
    tokens, slot, pos, out_rows = rows
    logits = np.empty((out_rows.shape[0], head.n), np.float32)
    if tokens.shape[0] == 0:
        return logits
    H = norm.shape[0]
    x_in = np.empty((0, H), np.float32) if x_in is None else x_in
    hidden = np.empty((0, H), np.float32) if hidden is None else hidden
    dims = (Hq, Hkv, D, st.shapes["w_down"][1], st.shapes["wqkv"][0], np.float32(eps), np.float32(scale),
            get_num_threads(), gated, np.float32(embed_scale), windows, rope_of, E, k_used, norm_topk)
    return _FORWARD.run(tokens.shape[0] * (st.work + head.n * head.k), SERIAL_FORWARD, (tokens, slot, pos, out_rows, x_in),
                        (embed, norm, head.data), st.layers, dims, (cos, sin, *cache), logits, hidden)
