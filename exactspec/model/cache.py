"""Paged KV cache: pools of blocks of BLOCK positions, handed to sequence slots as they grow.

Each slot has a row of the block table (its logical blocks -> blocks of the pool; -1: none yet).
`reserve` gives a slot the blocks that the positions of a forward need, lowest free block first (so
the memory the process touches follows the positions held, not max_batch x max_context: the pool
is allocated empty and a page becomes resident when a block in it is first written); `release`
returns a slot's blocks when its sequence ends. A block may have several holders (slots sharing a
prompt prefix, the prefix cache: prefix.py): it returns to the pool when the last lets go. Blocks
shared are full and never written again (a sequence writes at positions >= its cache length only).
Rollback costs nothing: a slot's valid length is its sequence's token count minus one, owned by the
decode loop, and the next forward overwrites the positions of rejected drafts.

Sliding-window layers (Gemma 3: five of every six; Mistral: all) keep their keys in a pool of their
own with a table of its own (`local_table`), and a slot lets go of a local block as soon as no row can
reach it again: where a slot's rows only ever move forward (`forward_only`: the decode loop's target
cache, whose next rows start at the committed length), a forward's rows at positions >= p read keys
> p - window, so `reserve` first drops the slot's local blocks wholly below that. (A draft model's cache
rolls back past its rejected drafts, to positions below its last rows': it keeps every block.) A sequence then holds
about window / BLOCK local blocks however long it grows (plus the rows of the forward in flight: with
chunked prefill, a chunk's): its sliding layers' KV is bounded by the window. Global layers' blocks
(`table`) are kept for every position, as before. Which blocks hold a position changes no bit: the
attention reads keys [max(0, p - window + 1), p] through the table, in position order.

Keys are stored transposed, (D, BLOCK) per block and kv head, so the attention kernel vectorizes
scores across a block's keys. Entries at positions >= a slot's length are garbage (zeros in a block
never used before): a row at position p uses keys 0..p only, and every forward writes its own rows'
keys before attending.
"""
from __future__ import annotations

import heapq

import numpy as np
import torch

from ..kernels.attention import BLOCK
from .memory import ensure_fits


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # how keys and values are stored


def block_bytes(n_layers: int, n_kv_heads: int, head_dim: int, kv_dtype: str = "float32") -> int:
    """Bytes of one KV block: BLOCK positions of every layer, keys and values."""
    return 2 * n_layers * n_kv_heads * head_dim * BLOCK * KV_DTYPES[kv_dtype].itemsize


class Pool:
    """n_blocks blocks of BLOCK positions of some layers' keys (L, Hkv, P, D, B) and values (L, Hkv, P, B, D),
    handed out lowest free first, each with a count of its holders."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int, dtype: torch.dtype):
        self.k = torch.empty(n_layers, n_kv_heads, n_blocks, head_dim, BLOCK, dtype=dtype)
        self.v = torch.empty(n_layers, n_kv_heads, n_blocks, BLOCK, head_dim, dtype=dtype)
        self._free = list(range(n_blocks))  # a heap: the lowest free block first
        self.refs = np.zeros(n_blocks, np.int32)  # holders of each block (slots, the prefix cache)
        self.zeroed = np.zeros(n_blocks, bool)  # handed out before (so written with zeros, then keys)

    @property
    def used(self) -> int:
        return self.k.shape[2] - len(self._free)

    @property
    def block_bytes(self) -> int:
        return 2 * self.k[:, :, :1].numel() * self.k.element_size()

    def take(self) -> int:
        """The lowest free block, held once; zeroed the first time it is handed out. The attention reads a
        block's 16 keys as one vector, also the positions not written yet (their scores are never
        used), and memory never written may hold subnormal floats, whose arithmetic takes ~100x longer
        (measured: attention 6x slower over a heap-recycled pool). Blocks used before hold keys."""
        blk = heapq.heappop(self._free)
        self.refs[blk] = 1
        if not self.zeroed[blk]:
            self.k[:, :, blk] = 0
            self.v[:, :, blk] = 0
            self.zeroed[blk] = True
        return blk

    def hold(self, block: int) -> None:
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            heapq.heappush(self._free, block)


class KVCache:
    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int, capacity: int,
                 spare_blocks: int = 0, kv_dtype: str = "float32", helpers: int = 0,
                 windows: np.ndarray | None = None, forward_only: bool = False):
        """`spare_blocks`: room beyond every slot at full capacity, for blocks the prefix cache keeps.
        `kv_dtype`: "float32", or "bfloat16" (each key and value rounded once when written).
        `helpers`: slots n_slots.. that hold a sequence's cache for one step (`fork`: a sibling branch
        of tree verification, decode/loop.py); they share its full blocks, so 2 blocks of room each.
        `windows` (n_layers,): each layer's sliding window (0: global); the layers with one keep their
        keys in the local pool. The pools are sized for every slot at full capacity (address space
        only: memory becomes resident as blocks are first written). `forward_only`: the caller never feeds
        a slot a row below its last forward's first row (so local blocks behind the window may go)."""
        w = np.zeros(n_layers, np.int64) if windows is None else np.asarray(windows, np.int64)
        local = w > 0
        self.capacity, self.n_slots = capacity, n_slots + helpers
        self.window = int(w.max()) if local.any() else 0  # local blocks are dropped below the widest window
        self.forward_only = forward_only
        self.is_local = local
        self.at = np.array([int((local[:i] == local[i]).sum()) for i in range(n_layers)], np.int64)  # index in its pool
        per_slot = -(-capacity // BLOCK)
        n_blocks = n_slots * per_slot + spare_blocks + 2 * helpers  # every slot full + the kept ones +
        # the helpers' own: reserve never runs out
        ensure_fits(n_blocks * block_bytes(n_layers, n_kv_heads, head_dim, kv_dtype),
                    f"a KV cache for {n_slots} sequences x {capacity} positions (max_batch x max_context)",
                    "max_context")
        dt = KV_DTYPES[kv_dtype]
        self.full = Pool(int((~local).sum()), n_kv_heads, head_dim, n_blocks, dt)  # global layers
        self.local = Pool(int(local.sum()), n_kv_heads, head_dim, n_blocks if self.window else 0, dt)
        self.table = np.full((self.n_slots, per_slot), -1, np.int32)
        self.local_table = np.full((self.n_slots, per_slot if self.window else 0), -1, np.int32)

    # The global layers' pool, as before sliding windows had one of their own (tests, metrics).
    @property
    def k(self) -> torch.Tensor:
        return self.full.k

    @property
    def v(self) -> torch.Tensor:
        return self.full.v

    @property
    def refs(self) -> np.ndarray:
        return self.full.refs

    @property
    def blocks_used(self) -> int:
        """Blocks of the global layers' pool in use (a block per 16 positions held, however many layers)."""
        return self.full.used

    @property
    def bytes_used(self) -> int:
        """Bytes of keys and values in blocks in use, both pools."""
        return self.full.used * self.full.block_bytes + self.local.used * self.local.block_bytes

    def layer(self, i: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """Layer i's block table, keys and values (its pool's)."""
        if self.is_local[i]:
            return self.local_table, self.local.k[self.at[i]], self.local.v[self.at[i]]
        return self.table, self.full.k[self.at[i]], self.full.v[self.at[i]]

    def _kinds(self) -> list[tuple[Pool, np.ndarray]]:
        return [(self.full, self.table)] + ([(self.local, self.local_table)] if self.window else [])

    def reserve(self, slot: np.ndarray, pos: np.ndarray) -> None:
        """Give each (slot, position) pair's block a place in the pools, if it has none yet; first let
        go of the local blocks that no row at these positions or later can read."""
        if slot.shape[0] == 0:
            return
        if self.window and self.forward_only:
            for s in np.unique(slot).tolist():
                self._forget(s, int(pos[slot == s].min()))
        for pool, table in self._kinds():
            need = table[slot, pos // BLOCK] < 0
            if need.any():
                for s, b in sorted(set(zip(slot[need].tolist(), (pos[need] // BLOCK).tolist()))):
                    if table[s, b] < 0:
                        table[s, b] = pool.take()

    def _forget(self, s: int, p: int) -> None:
        """Slot s's local blocks wholly below position p - window + 1 (rows at p or later never read them)."""
        row = self.local_table[s, : max(0, p - self.window + 1) // BLOCK]
        for b in row[row >= 0].tolist():
            self.local.drop(b)
        row[:] = -1

    def check_held(self, slot: np.ndarray, pos: np.ndarray) -> None:
        """Every block before each (slot, position) row's that its rows read is held (its keys were
        written): the attention reads keys through the tables, so a row after positions never fed would
        read outside the pool."""
        if slot.shape[0] == 1:  # a lone row (decoding one sequence): no grouping
            spans = [(int(slot[0]), int(pos[0]), int(pos[0]))]
        else:
            spans = [(int(s), int(pos[slot == s].min()), int(pos[slot == s].max())) for s in np.unique(slot)]
        for s, lo, p in spans:
            if (self.table[s, : p // BLOCK] < 0).any() or (
                    self.window and (self.local_table[s, max(0, lo - self.window + 1) // BLOCK: p // BLOCK] < 0).any()):
                raise IndexError(f"forward: slot {s} at position {p} before its earlier positions were written")

    def share(self, slot: int, i: int, block: int, local: int = -1) -> None:
        """The slot's i-th block is `block` (and its local block `local`, -1: none), already written (a
        shared prompt prefix)."""
        self.table[slot, i] = block
        self.full.hold(block)
        if local >= 0:
            self.local_table[slot, i] = local
            self.local.hold(local)

    def fork(self, src: int, dst: int, n: int) -> None:
        """Empty slot dst holds src's positions 0..n-1: src's full blocks shared (never written again: src
        writes at positions >= n), the one holding positions n - n % BLOCK .. n-1 copied (dst writes there)."""
        for pool, table in self._kinds():
            for i in range(n // BLOCK):
                if table[src, i] >= 0:  # (a local block below the window: let go)
                    table[dst, i] = table[src, i]
                    pool.hold(int(table[src, i]))
            if n % BLOCK:
                i = n // BLOCK
                blk = table[dst, i] = pool.take()
                pool.k[:, :, blk] = pool.k[:, :, table[src, i]]
                pool.v[:, :, blk] = pool.v[:, :, table[src, i]]

    def swap(self, a: int, b: int, i: int) -> None:
        """Slots a and b exchange their i-th blocks (a sibling branch's keys become the sequence's)."""
        for _, t in self._kinds():
            t[a, i], t[b, i] = t[b, i], t[a, i]

    def gather(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the slot's positions 0..n-1, contiguous: (L, Hkv, n, D) each, float32, every
        layer (a sliding layer's positions below its window once dropped: IndexError)."""
        ks, vs = [], []
        for i in range(self.is_local.shape[0]):
            table, k, v = self.layer(i)
            blocks = torch.from_numpy(table[slot, : -(-n // BLOCK)].astype(np.int64))
            if n and int(blocks.min()) < 0:
                raise IndexError(f"gather: slot {slot} holds fewer than {n} positions of layer {i}")
            H, _, D, B = k.shape
            ks.append(k[:, blocks].permute(0, 1, 3, 2).reshape(H, -1, D)[:, :n])
            vs.append(v[:, blocks].reshape(H, -1, D)[:, :n])
        return torch.stack(ks).float(), torch.stack(vs).float()

    def release(self, slot: int) -> None:
        """The slot's sequence ended: its blocks go back to the pools."""
        for pool, table in self._kinds():
            row = table[slot]
            for b in row[row >= 0].tolist():
                pool.drop(b)
            row[:] = -1
