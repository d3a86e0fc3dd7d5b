"""Model forward: close to transformers (oracle), and bitwise invariant across every axis."""
import pytest
import torch

import exactspec
from tests.helpers import ARCHS
from exactspec.tools.testing import hf_model


def _prompt(n, seed=0, vocab=320):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_close_to_transformers(ckpt, arch):
    folder = ckpt(arch)
    ours = exactspec.load(folder)
    ref = hf_model(folder)
    ids = _prompt(70, seed=3)  # > mistral's window of 48
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    got = ours.logits(ids)
    assert got.dtype == torch.float32 and got.shape == (70, 320)
    assert (got - want).abs().max() < 1e-5 * max(1.0, want.abs().max().item()) + 1e-6
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_bfloat16_weights_close_to_transformers_on_the_same_weights(ckpt):
    folder = ckpt("llama", dtype=torch.bfloat16)
    ours = exactspec.load(folder, dtype="bfloat16")
    ref = hf_model(folder, torch.float32)  # bf16 weights widened: our math is float32 too
    ids = _prompt(40)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert (ours.logits(ids) - want).abs().max() < 1e-5


def _decode_logits(model, ids, chunks):
    """Logits for every position of ids, fed to the cache in the given chunk sizes."""
    net = model.net
    cache = net.new_cache(1, len(ids) + 16)
    out, p = [], 0
    for c in chunks:
        t = torch.tensor(ids[p:p + c])
        out.append(net.forward(t, torch.zeros(len(t), dtype=torch.long), torch.arange(p, p + len(t)), cache))
        p += c
    return torch.cat(out)


def _chunks(n, size, first=1):
    out = [first]
    while sum(out) < n:
        out.append(min(size, n - sum(out)))
    return out


def test_a_row_after_positions_never_written_is_refused(ckpt):
    """The attention reads keys 0..p through the block table: a row whose earlier blocks were never given
    a place (its positions never fed) would read outside the pool (a segfault in a thread: the cost probe
    of decode/cost.py did this until 2026-12-05). A named error instead, and nothing written."""
    net = exactspec.load(ckpt("llama")).net
    cache = net.new_cache(2, 200)
    with pytest.raises(IndexError, match="slot 1 at position 40 before its earlier positions were written"):
        net.forward(torch.tensor([1]), torch.tensor([1]), torch.tensor([40]), cache)
    with pytest.raises(IndexError, match="slot 0 at position 35"):  # two rows of a verify chunk
        net.forward(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([34, 35]), cache)
    net.forward(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([0, 1]), cache)  # fed in order: fine
    net.forward(torch.tensor([3] * 16), torch.zeros(16, dtype=torch.long), torch.arange(2, 18), cache)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_invariance_matrix(ckpt, arch, dtype):
    """Logits of a position: (a) no-cache full forward == (b) token by token with the cache ==
    (c) chunks of 2..16 on top of the cache == (d) inside a batch with other sequences ==
    (e) with 1 thread. Bitwise."""
    model = exactspec.load(ckpt(arch), dtype=dtype)
    ids = _prompt(60, seed=1)
    full = model.logits(ids)  # (a)
    assert torch.equal(_decode_logits(model, ids, [1] * len(ids)), full)  # (b)
    for size in range(2, 17):  # (c)
        assert torch.equal(_decode_logits(model, ids, _chunks(len(ids), size, first=7)), full), size
    # (d) a batch: three other sequences of other lengths in other slots, rows interleaved
    net = model.net
    others = [_prompt(n, seed=10 + n) for n in (5, 33, 71)]
    seqs = [others[0], ids, others[1], others[2]]
    cache = net.new_cache(len(seqs), 80)
    tok, slot, pos = [], [], []
    for s, seq in enumerate(seqs):
        tok += seq
        slot += [s] * len(seq)
        pos += range(len(seq))
    order = torch.randperm(len(tok), generator=torch.Generator().manual_seed(0))
    # rows may come in any order as long as a row's keys are written in the same call or before
    got = net.forward(torch.tensor(tok)[order], torch.tensor(slot)[order], torch.tensor(pos)[order], cache)
    mine = torch.tensor(slot)[order] == 1
    assert torch.equal(got[mine][torch.argsort(torch.tensor(pos)[order][mine])], full)
    exactspec.set_num_threads(1)  # (e)
    try:
        assert torch.equal(model.logits(ids), full)
        assert torch.equal(_decode_logits(model, ids, _chunks(len(ids), 5)), full)
    finally:
        exactspec.set_num_threads(2)


def test_cache_capacity_and_garbage_do_not_matter(ckpt):
    model = exactspec.load(ckpt("qwen3"))
    ids = _prompt(30)
    full = model.logits(ids)
    net = model.net
    cache = net.new_cache(3, 200)
    cache.k.normal_()
    cache.v.normal_()  # garbage beyond what each forward writes
    got = net.forward(torch.tensor(ids), torch.full((30,), 2), torch.arange(30), cache)
    assert torch.equal(got, full)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_forward_equals_the_per_kernel_twin(ckpt, arch, dtype, monkeypatch):
    """The one-call forward (forward.py) vs `forward_ref` (one kernel call per step): logits and
    the cache contents bitwise, with the serial build and the threaded build, rows of two
    sequences interleaved, and a subset of output rows."""
    from exactspec.model import forward as F
    net = exactspec.load(ckpt(arch), dtype=dtype).net
    a, b = _prompt(37, seed=4), _prompt(52, seed=5)
    tok = torch.tensor(a + b)
    slot = torch.tensor([0] * len(a) + [1] * len(b))
    pos = torch.tensor(list(range(len(a))) + list(range(len(b))))
    order = torch.randperm(len(tok), generator=torch.Generator().manual_seed(1))
    tok, slot, pos = tok[order], slot[order], pos[order]
    rows = torch.tensor([0, 5, 88, 17])
    ref_cache = net.new_cache(2, 64)
    want = net.forward_ref(tok, slot, pos, ref_cache, rows)
    for serial_below in (1 << 40, 0):  # everything serial / everything threaded
        monkeypatch.setattr(F, "SERIAL_FORWARD", serial_below)
        cache = net.new_cache(2, 64)
        assert torch.equal(net.forward(tok, slot, pos, cache, rows), want), serial_below
        for sl, n in ((0, len(a)), (1, len(b))):
            for got, ref in zip(cache.gather(sl, n), ref_cache.gather(sl, n)):
                assert torch.equal(got, ref)


def test_rope_tables_grow_with_positions_and_hold_the_same_bits(ckpt, monkeypatch):
    """The RoPE tables cover ROPE_START positions at load and grow (doubling) as positions demand; an entry
    is a function of its position alone, so the logits are those of tables made whole at load."""
    from exactspec.model import transformer
    monkeypatch.setattr(transformer, "ROPE_START", 16)
    folder = ckpt("gemma3")  # a global and a local table
    model = exactspec.load(folder)
    assert model.net._cos_np.shape[:2] == (2, 16)
    ids = _prompt(70, seed=5)
    grown = _decode_logits(model, ids, _chunks(70, 9))
    assert model.net._cos_np.shape[1] == 128 and model.net.cos.shape[1] == 128
    whole = exactspec.load(folder)
    whole.net._grow_rope(whole.net.max_context)
    assert torch.equal(_decode_logits(whole, ids, [70]), grown)
    assert torch.equal(whole.net.cos[:, :128], model.net.cos) and torch.equal(whole.net.sin[:, :128], model.net.sin)
