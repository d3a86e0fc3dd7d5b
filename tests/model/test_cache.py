"""The paged KV cache: blocks handed out as positions arrive, lowest first, returned when a sequence
ends; memory resident by use, not by max_batch x max_context."""
import numpy as np
import torch

import exactspec
from exactspec.decode.loop import Batch
from exactspec.decode.request import make_request
from exactspec.kernels import BLOCK
from exactspec.model.cache import KVCache


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_blocks_follow_the_positions_held():
    c = KVCache(2, 3, 1, 4, 5 * BLOCK)
    c.reserve(np.array([1, 1, 0]), np.array([0, BLOCK + 3, 2 * BLOCK]))  # slot 1: blocks 0, 1; slot 0: block 2
    assert c.blocks_used == 3
    assert c.table[1, 0] >= 0 and c.table[1, 1] >= 0 and c.table[0, 2] >= 0 and c.table[0, 0] < 0
    assert sorted(c.table[c.table >= 0].tolist()) == [0, 1, 2]  # the lowest free blocks
    c.release(1)
    assert c.blocks_used == 1 and (c.table[1] < 0).all()
    c.reserve(np.array([2]), np.array([0]))
    assert c.table[2, 0] in (0, 1)  # a freed block is reused before fresh ones


def test_a_block_is_zeros_when_first_handed_out_and_keeps_its_keys_after():
    """The attention reads a block's 16 keys as one vector, unwritten positions too: never-written memory
    (here NaN; in a recycled heap, possibly subnormals: ~100x slower arithmetic) is zeroed on first use."""
    c = KVCache(2, 2, 1, 4, 2 * BLOCK)
    c.k.fill_(float("nan"))
    c.v.fill_(float("nan"))
    c.reserve(np.array([0, 1]), np.array([3, BLOCK + 1]))
    for b in (c.table[0, 0], c.table[1, 1]):
        assert (c.k[:, :, b] == 0).all() and (c.v[:, :, b] == 0).all()
    c.k[:, :, c.table[0, 0]] = 7.0  # written keys
    kept = int(c.table[0, 0])
    c.release(0)
    c.reserve(np.array([0]), np.array([0]))
    assert c.table[0, 0] == kept and (c.k[:, :, kept] == 7.0).all()  # used before: not zeroed again
    c.release(0)
    c.reserve(np.array([1]), np.array([0]))
    c.k[:, :, c.table[1, 1]] = 5.0
    c.fork(1, 0, BLOCK + 1)  # slot 1's partial block copied into a fresh one: the copy, not zeros
    assert c.table[0, 0] == c.table[1, 0] and c.table[0, 1] != c.table[1, 1]
    assert torch.equal(c.k[:, :, c.table[0, 1]], c.k[:, :, c.table[1, 1]])


def test_a_big_cache_is_not_resident_until_used():
    before = _rss()
    c = KVCache(4, 8, 2, 64, 8192)  # 268 MB of address space (max_batch 8 x 8192 positions)
    assert c.k.numel() * 8 > 250e6
    assert _rss() - before < 16e6
    c.reserve(np.zeros(1, np.int64), np.arange(1))
    c.k[:, :, c.table[0, 0]] = 1.0
    assert _rss() - before < 16e6


def test_batch_returns_every_block(ckpt):
    m = exactspec.load(ckpt("qwen2"))
    b = Batch(m.net, 3, 200)
    prompts = [m.encode("def f(x):"), m.encode("import os\nimport sys\n" * 3), m.encode("x = 1")]
    for p, n in zip(prompts, (5, 40, 20)):
        b.add(make_request(m.net.limits, p, n))
    seen = 0
    while b.running:
        b.step()
        held = sum(-(-(len(s.tokens) - 1) // BLOCK) for s in b.running)
        assert b.cache.blocks_used >= held
        seen = max(seen, b.cache.blocks_used)
    assert seen > 3 and b.cache.blocks_used == 0
