"""Continuous batching: sequences join and leave between steps; nobody's tokens change."""
import numpy as np
import pytest

import exactspec
from exactspec.decode.drafters import DraftModelDrafter, LookupDrafter
from exactspec.errors import GenerationError
from exactspec.decode import chunking
from exactspec.decode.loop import Batch


@pytest.mark.parametrize("drafter_kind", ["none", "model", "lookup"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_join_leave_and_slot_reuse_do_not_change_tokens(ckpt, drafter_kind, temperature):
    target = exactspec.load(ckpt("qwen3"))
    draft = exactspec.load(ckpt("llama", seed=7, layers=1, hidden=32))
    prompts = {"A": [5, 6, 7, 8], "B": list(range(30, 70)), "C": [9, 9, 9], "D": [100, 101]}
    kw = dict(temperature=temperature, seed=11, ignore_eos=True)
    alone = {k: target.generate(p, 40, **kw).token_ids for k, p in prompts.items()}

    drafter = {"none": None, "model": DraftModelDrafter(draft.net), "lookup": LookupDrafter()}[drafter_kind]
    b = Batch(target.net, n_slots=2, capacity=128, drafter=drafter)

    def req(k):
        return target.request(prompts[k], 40, num_draft_tokens=3 if drafter is not None else 0, **kw)
    got = {}
    seqs = {"A": b.add(req("A"), tag="A")}
    for _ in range(5):
        b.step()
    seqs["B"] = b.add(req("B"), tag="B")  # joins while A runs: prefill beside A's verify
    for _ in range(3):
        b.step()
    b.cancel(seqs["A"])  # leaves early; its slot is reused by C
    got["A"] = seqs["A"].generated
    seqs["C"] = b.add(req("C"), tag="C")
    assert seqs["C"].slot == seqs["A"].slot
    while b.running:
        b.step()
        if seqs["B"].finish_reason and "D" not in seqs:
            seqs["D"] = b.add(req("D"), tag="D")
    for k in "BCD":
        got[k] = seqs[k].generated
        assert seqs[k].finish_reason == "length"
    assert seqs["A"].finish_reason == "cancelled"
    assert got["A"] == alone["A"][: len(got["A"])] and len(got["A"]) >= 5
    for k in "BCD":
        assert got[k] == alone[k], k


def test_full_batch_refuses_another(ckpt):
    target = exactspec.load(ckpt("llama"))
    b = Batch(target.net, n_slots=1, capacity=32)
    b.add(target.request([1, 2], 4))
    assert not b.has_room
    with pytest.raises(GenerationError, match="no free slot"):
        b.add(target.request([3], 4))


@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("drafter_kind", ["none", "model", "lookup"])
def test_chunked_prefill_gives_the_same_tokens_and_logprobs(ckpt, chunk, drafter_kind):
    """A prompt fed in chunks of any size (each chunk's rows attend the keys earlier chunks wrote)
    gives bitwise the whole prefill's tokens and logprobs; meanwhile a short sequence decodes a
    token every step instead of waiting for the long prompt."""
    target = exactspec.load(ckpt("qwen3"))
    draft = exactspec.load(ckpt("llama", seed=7, layers=1, hidden=32))
    long, short = list(range(3, 60)), [5, 6, 7]
    kw = dict(temperature=0.8, seed=5, ignore_eos=True, logprobs=2)
    want = {n: target.generate(p, 12, **kw) for n, p in (("long", long), ("short", short))}
    drafter = {"none": None, "model": DraftModelDrafter(draft.net), "lookup": LookupDrafter()}[drafter_kind]
    b = Batch(target.net, n_slots=2, capacity=128, drafter=drafter, prefill_chunk=chunk)
    b.chunker.long_prompt = 0  # every prompt is held back beside others (a server's threshold: 256 tokens)
    k = 3 if drafter is not None else 0
    s = b.add(target.request(short, 12, num_draft_tokens=k, **kw))
    b.step()  # short: prefilled (3 tokens <= chunk, or chunked too when chunk = 1)
    while not s.prefilled:
        b.step()
    g = b.add(target.request(long, 12, num_draft_tokens=k, **kw))
    steps, fed = 0, 0
    while not g.prefilled:
        before, credit, busy = len(s.generated), g.credit, s.finish_reason is None
        b.step()
        steps += 1
        assert s.finish_reason is not None or len(s.generated) > before  # the short one never waits
        assert g.fed - fed <= chunk
        if busy:  # beside a decoding sequence: the chunk's attention (keys its rows read) within its credit
            assert (g.fed * (g.fed + 1) - fed * (fed + 1)) // 2 <= credit + b.chunker.grants[0]
        fed = g.fed
    assert steps >= -(-len(long) // chunk)
    while b.running:
        b.step()
    for seq, name in ((g, "long"), (s, "short")):
        assert seq.generated == want[name].token_ids, name
        assert [(x.token, x.logprob, x.top) for x in seq.logprobs] == \
            [(x.token, x.logprob, x.top) for x in want[name].logprobs], name


def test_a_long_prompts_late_chunks_wait_for_credit_beside_decoding(ckpt, monkeypatch):
    """Beside a decoding sequence, a chunk whose attention (p + 1 keys per row at position p) exceeds
    the step's grant is cut, down to no row at all until the credit covers one; the prefill still
    completes, and every token is its solo token."""
    monkeypatch.setattr(chunking, "attention_cost", lambda net: chunking.PREFILL_ATTENTION_SHARE / 40)  # 40 keys
    target = exactspec.load(ckpt("llama"))
    long, short = list(range(3, 150)), [5, 6, 7]
    want = [target.generate(p, n, ignore_eos=True).token_ids for p, n in ((long, 4), (short, 400))]
    b = Batch(target.net, n_slots=2, capacity=512, prefill_chunk=16)
    b.chunker.step_share, b.chunker.long_prompt = 0, 0  # the attention credit alone (the row cap: next test)
    s = b.add(target.request(short, 400, ignore_eos=True))
    b.step()
    g = b.add(target.request(long, 4, ignore_eos=True))
    fed, sizes = 0, []
    while not g.prefilled:
        b.step()
        sizes.append(g.fed - fed)
        fed = g.fed
    assert b.chunker.grants[0] == 40 and s.finish_reason is None  # the short one decoded all along
    assert sizes[0] == 8 and 0 in sizes and max(sizes[-5:]) < sizes[0]  # 1 + 2 + ... + 8 <= 40; late: cut, or none
    while b.running:
        b.step()
    assert [g.generated, s.generated] == want


def test_beside_decoding_a_chunk_carries_the_rows_its_measured_cost_allows(ckpt, monkeypatch):
    """With quantized weights a forward of 17 rows costs ~5 of 1 row: beside decoding, a prompt's chunk
    is cut to the rows that keep the step within 1 + PREFILL_STEP_SHARE of a one-row step; alone it
    takes whole chunks. Tokens are the solo tokens."""
    steep = np.array([1.0, 1.1, 1.3, 1.5, 1.7] + [2.0 + 0.3 * i for i in range(12)])  # SmolLM2 Q4_1's shape
    monkeypatch.setattr(chunking, "verify_costs", lambda net, context=32: steep)
    target = exactspec.load(ckpt("llama"))
    long, short = list(range(3, 80)), [5, 6, 7]
    want = [target.generate(p, n, ignore_eos=True).token_ids for p, n in ((long, 4), (short, 12))]
    b = Batch(target.net, n_slots=2, capacity=256, prefill_chunk=16)
    b.chunker.long_prompt = 0
    assert b.chunker.rows_beside() == 3  # costs[3] = 1.5 <= 1 + 0.5 < costs[4]
    s = b.add(target.request(short, 12, ignore_eos=True))
    b.step()
    g = b.add(target.request(long, 4, ignore_eos=True))
    fed, sizes = 0, []
    while not g.prefilled:
        busy = s.finish_reason is None
        b.step()
        sizes.append((busy, g.fed - fed))
        fed = g.fed
    assert max(n for busy, n in sizes if busy) == 3 and max(n for busy, n in sizes if not busy) == 16
    while b.running:
        b.step()
    assert [g.generated, s.generated] == want


def test_a_newcomer_beside_a_long_prompt_is_fed_whole_and_an_idle_chunk_is_bounded(ckpt, monkeypatch):
    """A step a newcomer may wait for is bounded: alone, a long prompt's chunk reads at most the idle
    grant of keys (at least one row). A newcomer's short prompt joining it is fed whole in its first
    step, while the long one's chunk in that step is held to the credit. Tokens are the solo tokens."""
    monkeypatch.setattr(chunking, "attention_cost", lambda net: 1.0 / 100)  # 100 keys per one-row forward
    target = exactspec.load(ckpt("llama"))
    long, short = list(range(3, 200)), [5, 6, 7, 8, 9]
    want = [target.generate(p, n, ignore_eos=True).token_ids for p, n in ((long, 3), (short, 6))]
    b = Batch(target.net, n_slots=2, capacity=256, prefill_chunk=64)
    b.chunker.long_prompt = 100  # the long one (197 tokens) is held back beside others, the newcomer's 5 never
    assert b.chunker.grants == (int(chunking.PREFILL_ATTENTION_SHARE * 100), int(chunking.PREFILL_IDLE_ATTENTION * 100))
    g = b.add(target.request(long, 3, ignore_eos=True))
    fed = []
    while g.fed < 150:
        b.step()
        fed.append(g.fed)
    steps = [(a, c) for a, c in zip([0] + fed, fed)]
    assert all((c * (c + 1) - a * (a + 1)) // 2 <= b.chunker.grants[1] or c == a + 1 for a, c in steps)
    assert steps[-1][1] - steps[-1][0] < 64  # late idle chunks cut below prefill_chunk
    before = g.fed
    s = b.add(target.request(short, 6, ignore_eos=True))
    b.step()
    assert s.prefilled and len(s.generated) == 1  # fed whole beside the long prompt
    assert (g.fed * (g.fed + 1) - before * (before + 1)) // 2 <= b.chunker.grants[0]  # the long one held to its credit
    while b.running:
        b.step()
    assert [g.generated, s.generated] == want


def test_a_cancel_stops_a_long_prefill_at_the_next_chunk(ckpt):
    target = exactspec.load(ckpt("llama"))
    b = Batch(target.net, n_slots=1, capacity=256, prefill_chunk=8)
    s = b.add(target.request(list(range(3, 200)), 4))
    b.step()
    b.step()
    assert s.fed == 16 and not s.prefilled
    b.cancel(s)
    assert not b.running and b.step() == [] and b.stats.forward_passes == 2
    with pytest.raises(exactspec.InvalidRequest, match="prefill_chunk=-1"):
        Batch(target.net, n_slots=1, capacity=8, prefill_chunk=-1)
