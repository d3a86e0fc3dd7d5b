"""num_draft_tokens="auto" prices a lookup's draft by its evidence: how many of the sequence's last tokens
the occurrence it copies matched. Fixed verify costs here (no timing in tests); tokens never change."""
import numpy as np
import pytest

import exactspec
from exactspec.decode import loop
from exactspec.decode.drafters import LookupDrafter, NgramPool
from exactspec.decode.loop import run_batch

COSTS = np.array([1.0 + 0.2 * k for k in range(17)])  # a verify row costs a fifth of a one-row forward


def test_lookup_follows_the_longest_match_and_reports_it():
    d = LookupDrafter(max_ngram=3)
    seq = [5, 1, 2, 3, 7, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert d.find(seq, 2) == ([7, 9], 4)  # (5, 1, 2, 3) matches further back than the later (9, 1, 2, 3)
    assert d.find([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == ([7, 8], 3)  # equal matches: the latest
    assert d.find([4, 4], 1) == ([4], 1) and d.find([1, 2], 3) == ([], 0)
    long = list(range(40)) * 2
    assert d.find(long, 1) == ([0], 3 + 16)  # followed back 16 tokens past the n-gram, no further


def test_pool_reports_its_evidence():
    pool = NgramPool(max_ngram=2)
    pool.add([1, 2, 3, 4, 5])
    pool.add([9, 2, 3, 7, 8])
    assert pool.find([0, 2, 3], 2) == ([7, 8], 2)
    assert pool.find([9, 2, 3], 2) == ([7, 8], 3)
    assert pool.find([6], 2) == ([], 0)


class Claims(LookupDrafter):
    """A lookup that proposes `answer`'s next tokens (or token 1, repeated, off it) claiming an m-token match."""

    def __init__(self, answer: list[int], m: int):
        super().__init__()
        self.answer, self.m, self.asked = answer, m, []

    def find(self, seq, k):
        self.asked.append(k)
        n = len(seq)
        right = self.answer[:n] == list(seq)
        return (self.answer[n:n + k] if right else [1] * k), self.m


@pytest.fixture
def fixed_costs(monkeypatch):
    monkeypatch.setattr(loop, "verify_costs", lambda net, context=32: COSTS)


def _run(target, prompt, drafter, k="auto"):
    req = target.request(prompt, 48, ignore_eos=True, num_draft_tokens=k)
    seqs, _ = run_batch(target.net, [req], drafter)
    return seqs[0]


def test_a_long_match_is_verified_further_than_a_short_one(ckpt, fixed_costs):
    target = exactspec.load(ckpt("llama"))
    prompt = [5, 9, 11, 40]
    plain = target.generate(prompt, 48, ignore_eos=True).token_ids
    answer = prompt + plain
    claims = Claims(answer, 1)
    strong, weak = _run(target, prompt, Claims(answer, 12)), _run(target, prompt, claims)
    assert strong.generated == weak.generated == plain
    assert strong.stats.accepted == strong.stats.proposed  # the claims were right
    assert strong.stats.steps < weak.stats.steps  # the same drafts, trusted further where the match was longer
    assert claims.asked[0] == 16  # asked for the most (the loop cuts the draft)


def test_weak_wrong_lookups_stop_being_verified(ckpt, fixed_costs):
    target = exactspec.load(ckpt("llama"))
    prompt = [5, 9, 11, 40]
    plain = target.generate(prompt, 48, ignore_eos=True).token_ids
    wrong = [t + 1 for t in prompt + plain]  # never the target's token
    s = _run(target, prompt, Claims(wrong, 1))
    assert s.generated == plain
    assert s.stats.proposed <= 2 and s.stats.steps == 47  # tried once (prior 0.3), then not worth a row
    fixed = _run(target, prompt, Claims(wrong, 1), k=4)  # a fixed k is never cut
    assert fixed.generated == plain and fixed.stats.proposed_at[3] == 43  # all but the last 4 steps: 4
