"""Continuous batching: sequences join and leave between steps; nobody's tokens change."""
import pytest

import exactspec
from exactspec.decode.drafters import DraftModelDrafter, LookupDrafter
from exactspec.errors import GenerationError
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
            assert (g.fed * (g.fed + 1) - fed * (fed + 1)) // 2 <= credit + b._grant
        fed = g.fed
    assert steps >= -(-len(long) // chunk)
    while b.running:
        b.step()
    for seq, name in ((g, "long"), (s, "short")):
        assert seq.generated == want[name].token_ids, name
        assert [(x.token, x.logprob, x.top) for x in seq.logprobs] == \
            [(x.token, x.logprob, x.top) for x in want[name].logprobs], name


def test_a_long_prompts_late_chunks_wait_for_credit_beside_decoding(ckpt):
    """Beside a decoding sequence, a chunk whose attention (p + 1 keys per row at position p) exceeds
    the step's grant is cut, down to no row at all until the credit covers one; the prefill still
    completes, and every token is its solo token."""
    target = exactspec.load(ckpt("llama"))
    long, short = list(range(3, 150)), [5, 6, 7]
    want = [target.generate(p, n, ignore_eos=True).token_ids for p, n in ((long, 4), (short, 400))]
    b = Batch(target.net, n_slots=2, capacity=512, prefill_chunk=16)
    s = b.add(target.request(short, 400, ignore_eos=True))
    b.step()
    g = b.add(target.request(long, 4, ignore_eos=True))
    fed, sizes = 0, []
    while not g.prefilled:
        b.step()
        sizes.append(g.fed - fed)
        fed = g.fed
    assert s.finish_reason is None  # the short one decoded all along
    assert sizes[0] > 0 and 0 in sizes and max(sizes[-5:]) < sizes[0]  # late chunks cut, or none
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
