"""Exact prefix caching: a prompt that starts with blocks an earlier sequence wrote takes them over,
and every token (and logprob) is bitwise what it is with the cache off: mid-block prompts, sharers
running at once, eviction under pressure, speculation rolling back beside shared blocks, scopes."""
import pytest

import exactspec
from exactspec.decode.drafters import DraftModelDrafter, LookupDrafter
from exactspec.decode.loop import Batch
from exactspec.kernels import BLOCK

SYSTEM = list(range(40, 40 + 2 * BLOCK + 5))  # 2 whole blocks and 5 tokens of a third


def _prompts():
    tails = [[7, 8, 9], [300, 301], list(range(200, 230)), [7, 8, 9, 10], [42]]
    return [SYSTEM + t for t in tails] + [SYSTEM[:BLOCK + 3], SYSTEM[: 2 * BLOCK + 1], [1, 2, 3]]


def _run(b: Batch, reqs: list, at: list[int]) -> list:
    """Decode: request i joins at step at[i] (or when a slot frees after it); returns the sequences."""
    seqs, step, pending = [None] * len(reqs), 0, list(range(len(reqs)))
    while pending or b.running:
        while pending and at[pending[0]] <= step and b.has_room:
            i = pending.pop(0)
            seqs[i] = b.add(reqs[i], tag=i)
        b.step()
        step += 1
    return seqs


@pytest.mark.parametrize("drafter_kind,arch", [("none", "qwen3"), ("lookup", "qwen3"), ("model", "qwen3"),
                                               ("lookup", "gemma3"), ("lookup", "qwen3moe")])  # Gemma: past its window of 16
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_prefix_cache_on_equals_off(ckpt, drafter_kind, arch, temperature):
    target = exactspec.load(ckpt(arch))
    draft = exactspec.load(ckpt("llama", seed=7, layers=1, hidden=32))
    prompts = _prompts()
    kw = dict(temperature=temperature, seed=5, ignore_eos=True, logprobs=2,
              num_draft_tokens=4 if drafter_kind != "none" else 0)
    reqs = [target.request(p, 24, **kw) for p in prompts]
    at = [0, 0, 3, 9, 9, 30, 30, 31]  # two sharers at once, then later ones while others run
    runs = {}
    for blocks in (0, 64):
        drafter = {"none": None, "lookup": LookupDrafter(), "model": DraftModelDrafter(draft.net)}[drafter_kind]
        b = Batch(target.net, 3, 160, drafter, prefill_chunk=0, prefix_blocks=blocks)
        seqs = _run(b, reqs, at)
        runs[blocks] = [(s.generated, [(x.token, x.logprob, x.top) for x in s.logprobs]) for s in seqs]
        if blocks:
            hits = [s.stats.cached_tokens for s in seqs]
            assert hits[0] == hits[1] == 0  # they joined together: nothing was cached yet
            assert hits[2] == hits[3] == hits[4] == 2 * BLOCK  # the third block is partial: computed
            assert hits[5] == BLOCK and hits[6] == 2 * BLOCK and hits[7] == 0
            assert b.cache.blocks_used == b.prefix.blocks  # every slot's blocks returned, the kept ones held
    assert runs[64] == runs[0]


def test_eviction_under_pressure_and_chunked_prefill(ckpt):
    target = exactspec.load(ckpt("llama"))
    prompts = [SYSTEM + [i] * (BLOCK + i) for i in range(6)] + [SYSTEM + [3] * (BLOCK + 3)]
    reqs = [target.request(p, 12, ignore_eos=True) for p in prompts]
    want = [target.generate(p, 12, ignore_eos=True).token_ids for p in prompts]
    b = Batch(target.net, 2, 120, None, prefill_chunk=5, prefix_blocks=3)
    seqs = _run(b, reqs, list(range(0, 70, 10)))
    assert [s.generated for s in seqs] == want
    assert b.prefix.blocks <= 3 and b.cache.blocks_used == b.prefix.blocks


def test_scopes_do_not_share(ckpt):
    target = exactspec.load(ckpt("llama"))
    p = SYSTEM + [9, 9]
    b = Batch(target.net, 2, 100, prefix_blocks=16)
    a = _run(b, [target.request(p, 4, cache_scope="alice")], [0])[0]
    other = _run(b, [target.request(p, 4, cache_scope="bob")], [0])[0]
    again = _run(b, [target.request(p, 4, cache_scope="alice")], [0])[0]
    assert (a.stats.cached_tokens, other.stats.cached_tokens, again.stats.cached_tokens) == (0, 0, 2 * BLOCK)
    assert a.generated == other.generated == again.generated
