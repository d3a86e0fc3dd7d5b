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
