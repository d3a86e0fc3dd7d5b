"""The paged KV cache: blocks handed out as positions arrive, lowest first, returned when a sequence
ends; memory resident by use, not by max_batch x max_context."""
import numpy as np
import pytest
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


def test_sliding_window_layers_let_go_of_blocks_behind_the_window():
    """Layers 0 and 2 slide (window 40), layer 1 is global: a slot's local blocks wholly below p - 39 for its
    first row p go back to the pool at the next reserve; the global ones stay; what rows still read is held."""
    c = KVCache(3, 2, 1, 4, 10 * BLOCK, windows=np.array([40, 0, 40]), forward_only=True)
    assert c.local.k.shape[0] == 2 and c.full.k.shape[0] == 1 and c.at.tolist() == [0, 0, 1]
    for p in range(0, 8 * BLOCK, 4):  # slot 0 fed 4 positions a step (chunked prefill, or a verify)
        c.reserve(np.zeros(4, np.int64), np.arange(p, p + 4))
        c.check_held(np.zeros(4, np.int64), np.arange(p, p + 4))
        lo = max(0, p - 39) // BLOCK
        assert (c.local_table[0, :lo] < 0).all() and (c.local_table[0, lo:(p + 3) // BLOCK + 1] >= 0).all()
    assert (c.table[0, :8] >= 0).all() and c.blocks_used == 8  # global: every position kept
    assert c.local.used == 3  # the last rows, 124..127, read keys 85.. : blocks 5..7
    assert c.bytes_used == 8 * c.full.block_bytes + 3 * c.local.block_bytes == (8 + 3 * 2) * 2 * 4 * BLOCK * 4
    t, k, v = c.layer(2)
    assert t is c.local_table and k.data_ptr() == c.local.k[1].data_ptr()
    c.local_table[0, 6] = -1  # a block the window still needs, gone: the forward is refused, not garbage
    with pytest.raises(IndexError, match="slot 0 at position 128 before"):
        c.check_held(np.zeros(1, np.int64), np.array([8 * BLOCK]))
    c.release(0)
    assert c.blocks_used == 0 and c.local.used == 1  # (the block unlinked by hand above was never returned)


def test_a_prefix_hit_needs_only_the_local_blocks_of_its_window():
    """A prefix cache entry that kept a sequence's global blocks but not the local ones it had let go of
    serves a prompt only where the window before its first computed position is all kept."""
    from exactspec.model.prefix import PrefixCache
    c = KVCache(2, 2, 1, 4, 10 * BLOCK, spare_blocks=8, windows=np.array([32, 0]), forward_only=True)
    tokens = list(range(100, 200))
    for p in range(100):  # decoded one position at a time: only the last ~2 local blocks held
        c.reserve(np.zeros(1, np.int64), np.array([p]))
    pc = PrefixCache(c, 16)
    pc.insert("", tokens, 0, 6)
    assert [n.local >= 0 for n in sorted(pc.nodes.values(), key=lambda n: n.id)] == [False] * 4 + [True] * 2
    assert len(pc.match("", tokens)) == 6  # (99 // 16 blocks) the first row, 96, reads keys 65.. (blocks 4, 5)
    assert pc.match("", tokens[:50]) == []  # row 48 reads keys 17.. (blocks 1, 2: let go), row 32 block 0 too
    c.release(0)
    blocks = pc.match("", tokens)
    for i, (b, local) in enumerate(blocks):
        c.share(1, i, b, local)
    c.check_held(np.ones(1, np.int64), np.array([96]))  # the second sequence may start at position 96


def test_gemma_decoding_holds_its_window_not_its_length(ckpt):
    """The tiny Gemma 3 (window 16 on 5 of its 6 layers), chunked prefill and speculation: the local pool
    holds a few blocks per sequence however long it grows, and every token is the one-forward recompute's."""
    from exactspec.decode.drafters import LookupDrafter
    m = exactspec.load(ckpt("gemma3"))
    prompt = list(range(2, 90)) * 2  # 176 tokens; repeats give the lookup drafter something to draft
    b = Batch(m.net, 2, 400, LookupDrafter(), prefill_chunk=24)
    seqs = [b.add(m.request(prompt, 120, ignore_eos=True, num_draft_tokens=4)),
            b.add(m.request(prompt[5:60], 80, ignore_eos=True, num_draft_tokens=4))]
    most = 0
    while b.running:
        b.step()
        most = max(most, b.cache.local.used)
    # per sequence: its window's blocks (16 / 16 + 1), the chunk's or verify's rows (24: 2 blocks) and one
    # partial: far below the 19 + 9 blocks the global layer holds at the end
    assert most <= 2 * 5, most
    assert b.cache.local.used == 0 and b.cache.blocks_used == 0
    for s, p, n in zip(seqs, (prompt, prompt[5:60]), (120, 80)):
        assert s.finish_reason == "length" and len(s.generated) == n
        ids = p + s.generated
        assert m.logits(ids[:-1])[len(p) - 1:].argmax(-1).tolist() == s.generated


def test_a_windowed_draft_model_keeps_its_blocks_for_its_rollbacks(ckpt):
    """A draft model's cache rolls back past its rejected drafts, below its last forward's rows: it is not
    forward_only, so a Gemma drafting for a Gemma keeps every block (letting go behind the window failed here:
    'slot 0 at position 41 before its earlier positions were written')."""
    t, d = exactspec.load(ckpt("gemma3")), exactspec.load(ckpt("gemma3", seed=3))
    p = list(range(2, 40))
    plain = t.generate(p, 120, ignore_eos=True).token_ids
    assert t.generate(p, 120, ignore_eos=True, draft=d, num_draft_tokens=8).token_ids == plain
