"""Static KV cache: preallocated buffers for S sequence slots; rollback = move a length pointer.

Keys are stored transposed, (D, C) per head, so the attention kernel can vectorize scores across
key positions. Entries at positions >= a slot's length are garbage: a row at position p reads
keys 0..p only, and every forward writes its own rows' keys before attending.
"""
from __future__ import annotations

import torch



class KVCache:
    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int, capacity: int):
        self.capacity = capacity
        self.k = torch.zeros(n_layers, n_slots, n_kv_heads, head_dim, capacity)  # (L, S, Hkv, D, C)
        self.v = torch.zeros(n_layers, n_slots, n_kv_heads, capacity, head_dim)  # (L, S, Hkv, C, D)
        self.lengths = [0] * n_slots  # tokens whose keys are valid, per slot
