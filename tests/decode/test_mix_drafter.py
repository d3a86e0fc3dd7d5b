"""MixDrafter's choice between a free lookup and a model drafter, by expected tokens per unit of time from
each source's acceptance measured online (fixed verify costs here: no timing in tests)."""
import numpy as np
import pytest

from exactspec.decode import drafters
from exactspec.decode.drafters import Drafter, LookupDrafter, MixDrafter
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


@pytest.fixture
def mix(monkeypatch):
    monkeypatch.setattr(drafters, "verify_costs", lambda net, context=32: COSTS)
    m = MixDrafter(LookupDrafter(), Model(0.05), target=None)
    m.begin(2, 64)
    return m


def expected(alpha: float, k: int, per_draft: float) -> float:
    return sum(alpha ** i for i in range(k + 1)) / (COSTS[k] + k * per_draft)


def test_untried_sources_prefer_the_free_lookup(mix):
    assert mix.choose(0, 3, 4) == 0  # both at the prior 0.5: a draft that costs nothing to make wins
    assert mix.choose(0, 0, 4) > 0  # no lookup draft: the model drafts


def test_the_source_that_is_accepted_on_this_sequence_wins(mix):
    for _ in range(6):
        mix.acc[0][0].add(3, 0)  # lookup: rejected at once, every time
        mix.acc[0][1].add(3, 3)  # the model: all accepted
    a = mix.acc[0][1].alpha
    k = mix.choose(0, 3, 8)
    assert k == 1 + int(np.argmax([expected(a, j, 0.05) for j in range(1, 9)]))
    assert mix.choose(1, 3, 8) == 0  # slot 1 learned nothing: per sequence


def test_a_costly_model_drafts_fewer_tokens(mix):
    for _ in range(6):
        mix.acc[0][1].add(3, 2)
    mix.model.cost = 0.0
    assert mix.choose(0, 0, 8) > 2
    mix.model.cost = 1.0  # a draft token as dear as a target forward
    assert mix.choose(0, 0, 8) <= 2


def test_it_learns_each_source_from_the_tokens_that_followed(mix):
    p = [SamplingParams()]
    seq = [1, 2, 3, 1, 2]  # lookup proposes 3, 1, 2 (what followed "1, 2")
    assert mix.propose([0], [seq], [3], p) == [[3, 1, 2]]
    seq += [7, 7]  # "3" was not the next token: the lookup's draft was rejected
    assert mix.propose([0], [seq], [3], p) == [[9, 9]]  # now the model's guess is worth more (its best k: 2)
    assert mix.acc[0][0].alpha < 0.5 and mix.acc[0][1].alpha == 0.5
    seq += [9, 9, 4, 5]  # both of the model's accepted; nothing to look up after "4, 5"
    assert mix.propose([0], [seq], [8], p) == [[9] * mix.model.asked[-1]]
    assert mix.acc[0][1].alpha > 0.8 and mix.model.asked[-1] >= 4
    mix.release(0)
    assert mix.acc[0][0].alpha == 0.5 and mix.last[0] is None
