"""Paged KV cache: a pool of blocks of BLOCK positions, handed to sequence slots as they grow.

Each slot has a row of the block table (its logical blocks -> blocks of the pool; -1: none yet).
`reserve` gives a slot the blocks that the positions of a forward need, lowest free block first (so
the memory the process touches follows the positions held, not max_batch x max_context: the pool
is allocated empty and a page becomes resident when a block in it is first written); `release`
returns a slot's blocks when its sequence ends. A block may have several holders (slots sharing a
prompt prefix, the prefix cache: prefix.py): it returns to the pool when the last lets go. Blocks
shared are full and never written again (a sequence writes at positions >= its cache length only).
Rollback costs nothing: a slot's valid length is its sequence's token count minus one, owned by the
decode loop, and the next forward overwrites the positions of rejected drafts.

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


class KVCache:
    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int, capacity: int,
                 spare_blocks: int = 0, kv_dtype: str = "float32", helpers: int = 0):
        """`spare_blocks`: room beyond every slot at full capacity, for blocks the prefix cache keeps.
        `kv_dtype`: "float32", or "bfloat16" (each key and value rounded once when written).
        `helpers`: slots n_slots.. that hold a sequence's cache for one step (`fork`: a sibling branch
        of tree verification, decode/loop.py); they share its full blocks, so 2 blocks of room each."""
        self.capacity, self.n_slots = capacity, n_slots + helpers
        per_slot = -(-capacity // BLOCK)
        n_blocks = n_slots * per_slot + spare_blocks + 2 * helpers  # every slot full + the kept ones +
        # the helpers' own: reserve never runs out
        ensure_fits(n_blocks * block_bytes(n_layers, n_kv_heads, head_dim, kv_dtype),
                    f"a KV cache for {n_slots} sequences x {capacity} positions (max_batch x max_context)",
                    "max_context")
        dt = KV_DTYPES[kv_dtype]
        self.k = torch.empty(n_layers, n_kv_heads, n_blocks, head_dim, BLOCK, dtype=dt)  # (L, Hkv, P, D, B)
        self.v = torch.empty(n_layers, n_kv_heads, n_blocks, BLOCK, head_dim, dtype=dt)  # (L, Hkv, P, B, D)
        self.table = np.full((self.n_slots, per_slot), -1, np.int32)
        self._free = list(range(n_blocks))  # a heap: the lowest free block first
        self.refs = np.zeros(n_blocks, np.int32)  # holders of each block (slots, the prefix cache)
        self.zeroed = np.zeros(n_blocks, bool)  # handed out before (so written with zeros, then keys)

    @property
    def blocks_used(self) -> int:
        return self.k.shape[2] - len(self._free)

    def reserve(self, slot: np.ndarray, pos: np.ndarray) -> None:
        """Give each (slot, position) pair's block a place in the pool, if it has none yet."""
        if slot.shape[0] == 0:
            return
        need = self.table[slot, pos // BLOCK] < 0
        if need.any():
            for s, b in sorted(set(zip(slot[need].tolist(), (pos[need] // BLOCK).tolist()))):
                if self.table[s, b] < 0:
                    self.table[s, b] = self._take()

    def check_held(self, slot: np.ndarray, pos: np.ndarray) -> None:
        """Every block before each (slot, position) row's is held (its keys were written): the attention
        reads keys 0..p through the table, so a row after positions never fed would read outside the pool."""
        if slot.shape[0] == 1:  # a lone row (decoding one sequence): no grouping
            last = [(int(slot[0]), int(pos[0]))]
        else:
            last = [(int(s), int(pos[slot == s].max())) for s in np.unique(slot)]
        for s, p in last:
            if (self.table[s, : p // BLOCK] < 0).any():
                raise IndexError(f"forward: slot {s} at position {p} before its earlier positions were written")

    def _take(self) -> int:
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

    def share(self, slot: int, i: int, block: int) -> None:
        """The slot's i-th block is `block`, already written (a shared prompt prefix)."""
        self.table[slot, i] = block
        self.hold(block)

    def hold(self, block: int) -> None:
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            heapq.heappush(self._free, block)

    def fork(self, src: int, dst: int, n: int) -> None:
        """Empty slot dst holds src's positions 0..n-1: src's full blocks shared (never written again: src
        writes at positions >= n), the one holding positions n - n % BLOCK .. n-1 copied (dst writes there)."""
        for i in range(n // BLOCK):
            self.share(dst, i, int(self.table[src, i]))
        if n % BLOCK:
            i = n // BLOCK
            blk = self.table[dst, i] = self._take()
            self.k[:, :, blk] = self.k[:, :, self.table[src, i]]
            self.v[:, :, blk] = self.v[:, :, self.table[src, i]]

    def swap(self, a: int, b: int, i: int) -> None:
        """Slots a and b exchange their i-th blocks (a sibling branch's keys become the sequence's)."""
        self.table[a, i], self.table[b, i] = self.table[b, i], self.table[a, i]

    def gather(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the slot's positions 0..n-1, contiguous: (L, Hkv, n, D) each, float32."""
        blocks = torch.from_numpy(self.table[slot, : -(-n // BLOCK)].astype(np.int64))
        if n and int(blocks.min()) < 0:
            raise IndexError(f"gather: slot {slot} holds fewer than {n} positions")
        L, H, _, D, B = self.k.shape
        k = self.k[:, :, blocks].permute(0, 1, 2, 4, 3).reshape(L, H, -1, D)[:, :, :n]
        v = self.v[:, :, blocks].reshape(L, H, -1, D)[:, :, :n]
        return k.float(), v.float()

    def release(self, slot: int) -> None:
        """The slot's sequence ended: its blocks go back to the pool."""
        row = self.table[slot]
        for b in row[row >= 0].tolist():
            self.drop(b)
        row[:] = -1
