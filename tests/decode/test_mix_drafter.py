"""MixDrafter's choice between a free lookup and a model drafter, by expected tokens per unit of time from
each source's acceptance measured online (fixed verify costs here: no timing in tests)."""
import numpy as np
import pytest

from exactspec.decode import cost
from exactspec.decode import mix as mix_module
from exactspec.decode.drafters import Drafter, LookupDrafter
from exactspec.decode.mix import MixDrafter
from exactspec.decode.sampling import SamplingParams

COSTS = np.array([1.0, 1.05, 1.1, 1.15, 1.2] + [1.2 + 0.2 * i for i in range(1, 13)])


class Model(Drafter):
    """Proposes `guess` tokens (always token 9); records the k it was asked for."""

    def __init__(self, cost: float):
        self.cost, self.asked = cost, []

    def propose(self, slots, seqs, ks, params):
        self.asked += ks
        return [[9] * k for k in ks]

    def cost_per_token(self, target):
        return self.cost


class Target:
    """A stand-in for the target model: a key for what its sequences' lookups were seen to do (cost.seen_lookups)."""


@pytest.fixture
def mix(monkeypatch):
    monkeypatch.setattr(mix_module, "verify_costs", lambda net, context=32: COSTS)
    m = MixDrafter(LookupDrafter(), Model(0.05), target=Target())
    m.begin(2, 64)
    return m


def expected(alpha: float, k: int, per_draft: float) -> float:
    return sum(alpha ** i for i in range(k + 1)) / (COSTS[k] + k * per_draft)


def test_untried_sources_prefer_the_free_lookup(mix):
    assert mix.choose(0, 3, 3, 4) == (3, 0)  # a 3-token match (prior 0.8) costs nothing to make: it wins
    assert mix.choose(0, 0, 0, 4)[1] > 0  # no lookup draft: the model drafts
    assert mix.choose(0, 3, 1, 4)[1] > 0  # a 1-token match (prior 0.3) is worth less than the model's guess


def test_the_source_that_is_accepted_on_this_sequence_wins(mix):
    for _ in range(6):
        mix.acc[0][0].add(3, 3, 0)  # lookups of 3-token matches: rejected at once, every time
        mix.acc[0][1].add(3, 3)  # the model: all accepted
    a = mix.acc[0][1].alpha
    assert mix.choose(0, 3, 3, 8) == (0, 1 + int(np.argmax([expected(a, j, 0.05) for j in range(1, 9)])))
    assert mix.choose(1, 3, 3, 8) == (3, 0)  # slot 1 learned nothing: per sequence
    n, w = mix.choose(0, 8, 12, 8)  # a longer match is another class: still at its prior (0.95)
    assert n >= 4 and w == 0


def test_a_costly_model_drafts_fewer_tokens(mix):
    for _ in range(6):
        mix.acc[0][1].add(3, 2)
    mix.model.cost = 0.0
    assert mix.choose(0, 0, 0, 8)[1] > 2
    mix.model.cost = 1.0  # a draft token as dear as a target forward
    assert mix.choose(0, 0, 0, 8)[1] <= 2


def test_it_learns_each_source_from_the_tokens_that_followed(mix):
    p = [SamplingParams()]
    seq = [1, 2, 3, 1, 2]  # lookup proposes 3, 1, 2 (what followed "1, 2": a 2-token match)
    assert mix.propose([0], [seq], [3], p) == [[3, 1, 2]]
    seq += [7, 7]  # "3" was not the next token: the lookup's draft was rejected
    assert mix.propose([0], [seq], [3], p) == [[9, 9]]  # now the model's guess is worth more (its best k: 2)
    assert mix.acc[0][0].alpha(2) < 0.6 and mix.acc[0][0].alpha(3) == 0.8 and mix.acc[0][1].alpha == 0.5
    seq += [9, 9, 4, 5]  # both of the model's accepted; nothing to look up after "4, 5"
    assert mix.propose([0], [seq], [8], p) == [[9] * mix.model.asked[-1]]
    assert mix.acc[0][1].alpha > 0.8 and mix.model.asked[-1] >= 4
    mix.release(0)  # the slot's next sequence starts from what the earlier ones saw (cost.seen_lookups, seen)
    seen = cost.seen_lookups(mix.target)
    assert mix.acc[0][0].alpha(2) == seen.alpha(2) < 0.6 and mix.acc[0][0].alpha(3) == 0.8 and mix.last[0] is None


def test_a_model_not_worth_asking_is_asked_for_one_token_now_and_then(mix):
    """A probe after 1, 2, 4 ... idle steps, or after as many as make its expected loss (a 2-row verify and a
    draft step against the plain steps of its 1 + alpha tokens) at most cost.PROBE_SHARE of their time."""
    mix.model.cost = 0.5
    for _ in range(8):
        mix.acc[0][1].add(3, 0)
    assert mix.choose(0, 0, 0, 8) == (0, 0)  # drafting is worth less than a plain step
    wait = cost.probe_pause(mix.acc[0][1].alpha, COSTS, cost.DraftCost(0.5, 0.0))
    assert wait == 23  # (1.05 + 0.5 - 1.097) / 0.02
    seq, asked = [1, 2, 3, 4], []
    for _ in range(60):
        before = len(mix.model.asked)
        mix.propose([0], [seq], [8], [SamplingParams()])
        asked.append(mix.model.asked[-1] if len(mix.model.asked) > before else 0)
        seq = seq + [100 + len(seq)]  # never the model's 9: each probe is rejected
    at = [i for i, a in enumerate(asked) if a]
    assert at[0] == wait - 1 and all(asked[i] == 1 for i in at) and 2 <= len(at) and at[1] - at[0] >= wait
    mix.model.cost = 0.05  # cheap drafts: the backoff's 1, 2, 4 ... (a probe's loss is small)
    for _ in range(8):
        mix.acc[1][1].add(3, 0)
    seq, asked = [1, 2, 3, 4], []
    for _ in range(15):
        before = len(mix.model.asked)
        mix.propose([1], [seq], [8], [SamplingParams()])
        asked.append(mix.model.asked[-1] if len(mix.model.asked) > before else 0)
        seq = seq + [100 + len(seq)]
    assert asked == [1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1]  # after 1, 2, 4, 8 steps


