"""Static KV cache: preallocated buffers for S sequence slots. Rollback costs nothing: a slot's
valid length is its sequence's token count minus one, owned by the decode loop, and the next
forward overwrites the positions of rejected drafts.

Keys are stored transposed, (D, C) per head, so the attention kernel can vectorize scores across
key positions. Entries at positions >= a slot's length are garbage: a row at position p reads
keys 0..p only, and every forward writes its own rows' keys before attending.
"""
from __future__ import annotations

import torch

from .memory import ensure_fits


class KVCache:
    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int, capacity: int):
        ensure_fits(2 * n_layers * n_slots * n_kv_heads * head_dim * capacity * 4,
                    f"a KV cache for {n_slots} sequences x {capacity} positions (max_batch x max_context)",
                    "max_context")
        self.capacity = capacity
        self.k = torch.zeros(n_layers, n_slots, n_kv_heads, head_dim, capacity)  # (L, S, Hkv, D, C)
        self.v = torch.zeros(n_layers, n_slots, n_kv_heads, capacity, head_dim)  # (L, S, Hkv, C, D)
        self.n_slots = n_slots
