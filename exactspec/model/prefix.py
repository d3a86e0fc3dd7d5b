"""Exact prefix caching: full KV blocks of earlier sequences, found again by their exact tokens.

A block's keys and values are a function of the tokens at and before its positions (batch
invariance: whatever step, chunk or batch computed them), so a new sequence whose prompt starts
with the same tokens may take the blocks over instead of computing them: its output is bitwise the
same with the cache on or off. The blocks form a trie: a node is (parent node, the block's BLOCK
token ids), compared exactly (no hash stands for the tokens). Each trie has a scope (a tenant: a
shared cache answers a hit faster, a timing side channel between clients). At most `max_blocks`
blocks are kept; the least recently used go first, leaves before their parents (a path is touched
from its deepest node up, so an ancestor is never older than its descendants).
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..kernels.attention import BLOCK
from .cache import KVCache


@dataclass(eq=False)
class _Node:
    id: int
    block: int
    local: int  # the sliding-window layers' block (-1: none kept)
    key: tuple
    parent: "_Node | None"
    children: int = 0


class PrefixCache:
    def __init__(self, kv: KVCache, max_blocks: int):
        self.kv, self.max_blocks = kv, max_blocks
        self.nodes: collections.OrderedDict[tuple, _Node] = collections.OrderedDict()  # oldest first
        self._ids = itertools.count(1)
        self.hit_tokens = 0  # prompt tokens taken from the cache
        self.looked_up_tokens = 0  # prompt tokens of the sequences that asked

    def _path(self, scope: str, tokens: Sequence[int], n: int) -> list[_Node]:
        """The cached nodes of the first n blocks of `tokens`, up to the first one missing."""
        path: list[_Node] = []
        parent: object = ("scope", scope)
        for i in range(n):
            node = self.nodes.get((parent, tuple(tokens[i * BLOCK:(i + 1) * BLOCK])))
            if node is None:
                break
            path.append(node)
            parent = node.id
        return path

    def _touch(self, path: list[_Node]) -> None:
        for node in reversed(path):
            self.nodes.move_to_end(node.key)

    def _usable(self, path: list[_Node]) -> int:
        """The most leading nodes of `path` a sequence can start after: with sliding windows, the local
        blocks that the first position left to compute reads must all be kept."""
        n, w = len(path), self.kv.window
        while w and n and any(node.local < 0 for node in path[max(0, n * BLOCK - w + 1) // BLOCK: n]):
            n -= 1
        return n

    def match(self, scope: str, prompt: Sequence[int]) -> list[tuple[int, int]]:
        """(block, local block) pairs holding a prefix of `prompt`: whole blocks, and never its last token
        (whose forward gives the first new token's logits)."""
        path = self._path(scope, prompt, (len(prompt) - 1) // BLOCK)
        path = path[:self._usable(path)]
        self._touch(path)
        self.looked_up_tokens += len(prompt)
        self.hit_tokens += len(path) * BLOCK
        return [(node.block, node.local) for node in path]

    def insert(self, scope: str, tokens: Sequence[int], slot: int, n: int) -> None:
        """Keep the first n blocks of the sequence in cache slot `slot` (its i-th blocks hold
        tokens[i*B:(i+1)*B], written)."""
        blocks = self.kv.table[slot]
        local = self.kv.local_table[slot] if self.kv.window else np.full(n, -1)
        path = self._path(scope, tokens, n)
        parent = path[-1] if path else None
        for i in range(len(path), n):
            key = (parent.id if parent is not None else ("scope", scope), tuple(tokens[i * BLOCK:(i + 1) * BLOCK]))
            node = _Node(next(self._ids), int(blocks[i]), int(local[i]), key, parent)
            self.kv.full.hold(node.block)
            if node.local >= 0:
                self.kv.local.hold(node.local)
            self.nodes[key] = node
            if parent is not None:
                parent.children += 1
            path.append(node)
            parent = node
        self._touch(path)
        while len(self.nodes) > self.max_blocks:
            self._evict()

    def _evict(self) -> None:
        for key, node in self.nodes.items():  # the oldest leaf (leaves come first, see the module doc)
            if node.children == 0:
                break
        del self.nodes[key]
        if node.parent is not None:
            node.parent.children -= 1
        self.kv.full.drop(node.block)
        if node.local >= 0:
            self.kv.local.drop(node.local)

    @property
    def blocks(self) -> int:
        return len(self.nodes)
