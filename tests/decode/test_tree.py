"""Tree verification (decode/loop.py, model/cache.py fork/swap): a sibling of a draft's first token is
verified in a helper slot holding a copy of the sequence's cache, in the same forward as the chain. Each
node's logits are plain decoding's logits of that node's path, bitwise (the helper slot is a contiguous
sequence, whatever block the fork cut); the winner's keys become the sequence's by a block swap."""
import numpy as np
import pytest
import torch

import exactspec
from exactspec import kernels as K
from exactspec.errors import InvalidRequest
from exactspec.kernels.attention import BLOCK
from exactspec.model.transformer import Rows


def plain_logits(net, path: list[int]) -> torch.Tensor:
    """The last row's logits of one forward of `path` alone, from an empty cache."""
    rows = Rows()
    rows.add(0, path, 0)
    return rows.forward(net, net.new_cache(1, 128))[0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [5, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 7])  # valid positions at the fork
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # Gemma: past its window of 16, local blocks let go
def test_each_node_of_a_tree_gets_its_paths_plain_logits(ckpt, n, threads, arch):
    net = exactspec.load(ckpt(arch)).net
    rng = np.random.default_rng(n)
    seq = rng.integers(0, net.cfg.vocab_size, n + 1).tolist()  # n positions cached, then the last token
    chain, sibs = [11, 12, 13], [21, 22]
    K.set_num_threads(threads)
    try:
        cache = net.new_cache(2, 128, helpers=len(sibs), forward_only=True)  # (as the decode loop's)
        rows = Rows()
        rows.add(1, seq[:-1], 0)  # the sequence in slot 1 (slot 0 stays empty)
        rows.forward(net, cache)
        tree = Rows()
        tree.add(1, [seq[-1]] + chain, n, logits_from=0)
        for j, t in enumerate(sibs):
            cache.fork(1, 2 + j, n)
            tree.add(2 + j, [seq[-1], t], n, logits_from=0)
        got = tree.forward(net, cache)
    finally:
        K.set_num_threads(2)
    want = [plain_logits(net, seq + chain[:i]) for i in range(len(chain) + 1)]
    for t in sibs:
        want += [plain_logits(net, seq), plain_logits(net, seq + [t])]
    for i, w in enumerate(want):
        assert torch.equal(got[i], w), i
    assert cache.refs[cache.table[1, : n // BLOCK]].tolist() == [1 + len(sibs)] * (n // BLOCK)  # shared, not copied
    cache.swap(1, 3, (n + 1) // BLOCK)  # the second sibling won: its key (position n + 1) becomes slot 1's
    for h in (2, 3):
        cache.release(h)
    assert cache.blocks_used == int((cache.table[1] >= 0).sum())  # the helpers' own blocks are back
    assert cache.local.used == int((cache.local_table[1] >= 0).sum())  # (Gemma's local ones too)
    nxt = Rows()
    nxt.add(1, [7], n + 2)  # decoding goes on from the sibling's path
    assert torch.equal(nxt.forward(net, cache)[0], plain_logits(net, seq + [sibs[1], 7]))


def test_draft_branches_is_checked(ckpt):
    m = exactspec.load(ckpt("llama"))
    with pytest.raises(InvalidRequest, match="draft_branches"):
        m.generate([1, 2, 3], 4, draft="lookup", draft_branches=0)
