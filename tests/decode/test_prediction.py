"""Predicted Outputs (OpenAI's `prediction`): the caller's guess at the output is proposed as drafts.
Only the speed depends on it: every token (and logprob) is plain decoding's, whether the guess is
right, edited, or garbage, with or without another drafter, greedy or seeded, alone or in a batch."""
import numpy as np
import pytest

import exactspec
from exactspec.decode import loop
from exactspec.decode.drafters import from_prediction

PROMPTS = [[5, 6, 7, 8], [100, 3, 100, 3, 9], list(range(20, 60))]


def _edited(out: list[int]) -> list[int]:
    """The output with a token changed, two inserted and a stretch deleted: an edit of a file."""
    e = list(out)
    e[3] = (e[3] + 1) % 256
    e[10:10] = [1, 2]
    del e[20:24]
    return e


def test_from_prediction_follows_the_output_through_the_guess():
    pred = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7]
    assert from_prediction(pred, [], 4) == [1, 2, 3, 9]  # before the first token: its start
    assert from_prediction(pred, [1, 2], 3) == [3, 9, 9]  # the copy nearest the output's length
    assert from_prediction(pred, [1, 2, 3, 9, 9, 1, 2], 2) == [3, 7]  # the second copy, not the first
    assert from_prediction(pred, [4, 4], 3) == []  # nothing matches
    assert from_prediction(pred, [1, 2], 0) == [] and from_prediction([], [1], 3) == []


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_prediction_changes_speed_never_tokens(ckpt, temperature, monkeypatch):
    monkeypatch.setattr(loop, "verify_costs", lambda net, context=32: np.ones(17))  # the k chosen: not a timing
    m = exactspec.load(ckpt("llama"))
    kw = dict(temperature=temperature, seed=3, ignore_eos=True, logprobs=2)
    plain = m.generate_batch(PROMPTS, 40, **kw)
    outs = [r.token_ids for r in plain]
    lps = [[(x.token, x.logprob, x.top) for x in r.logprobs] for r in plain]
    guesses = {"exact": outs, "edited": [_edited(o) for o in outs], "garbage": [[9, 8, 7] * 20] * 3,
               "mixed": [outs[0], None, _edited(outs[2])]}
    for name, preds in guesses.items():
        for draft in (None, "lookup"):
            got = m.generate_batch(PROMPTS, 40, prediction=preds, draft=draft, num_draft_tokens=3, **kw)
            assert [r.token_ids for r in got] == outs, (name, draft)
            assert [[(x.token, x.logprob, x.top) for x in r.logprobs] for r in got] == lps, (name, draft)
            if name == "exact" and draft is None:  # a right guess: up to 16 tokens per forward ("auto" k)
                assert all(r.stats.forward_passes <= 8 for r in got), [r.stats.forward_passes for r in got]
                assert all(r.stats.prediction_accepted >= 30 and r.stats.prediction_rejected == 0 for r in got)
            if name == "garbage":
                assert sum(r.stats.prediction_accepted for r in got) < 10


def test_prediction_beside_a_draft_model_and_as_text(ckpt):
    m = exactspec.load(ckpt("llama"))
    draft = exactspec.load(ckpt("llama", seed=7, layers=1, hidden=32))
    want = m.generate(PROMPTS[2], 30, ignore_eos=True).token_ids
    got = m.generate(PROMPTS[2], 30, ignore_eos=True, draft=draft, prediction=_edited(want))
    assert got.token_ids == want and got.stats.prediction_accepted > 0


def test_bad_predictions_are_named(ckpt):
    m = exactspec.load(ckpt("llama"))
    with pytest.raises(exactspec.InvalidRequest, match="prediction: token id 99999 outside the vocabulary"):
        m.generate([1, 2], 4, prediction=[3, 99999])
    ids = m.generate(PROMPTS[0], 12, ignore_eos=True).token_ids
    got = m.generate_batch(PROMPTS[:2], 12, ignore_eos=True, prediction=[np.int64(t) for t in ids])  # one for all
    assert got[0].token_ids == ids and got[0].stats.prediction_accepted > 0
    with pytest.raises(exactspec.InvalidRequest, match="prediction: 2 predictions for 3 prompts"):
        m.generate_batch(PROMPTS, 4, prediction=[[1], [2]])


def test_a_prediction_longer_than_the_context_is_cut_not_refused(ckpt):
    """Issue 40: a hint, as OpenAI's API takes it: a prediction past the context was a 400."""
    m = exactspec.load(ckpt("llama"), max_context=64)
    want = m.generate(PROMPTS[0], 20, ignore_eos=True).token_ids
    got = m.generate(PROMPTS[0], 20, ignore_eos=True, prediction=want * 10)  # 200 tokens, 64 positions
    assert got.token_ids == want and got.stats.prediction_accepted > 0
    with pytest.raises(exactspec.InvalidRequest, match="prediction: token id 99999 outside the vocabulary"):
        m.generate([1, 2], 4, prediction=[3] * 10 + [99999])  # what stays is checked
    m.generate([1, 2], 4, prediction=[3] * 100 + [99999])  # what is cut is not
