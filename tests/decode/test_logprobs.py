"""A token's logprob is a function of its prefix alone, however it was generated: plain decoding,
any drafter and k (the verify forward), inside a batch, with 1 or 2 threads, and a teacher-forced
scoring pass (`score`) all give the same float, bitwise."""
import math

import pytest
import torch

import exactspec
from exactspec import kernels as K

PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 70)), [9, 9, 9, 4]]


@pytest.fixture(scope="module")
def pair(ckpt):
    return exactspec.load(ckpt("qwen3")), exactspec.load(ckpt("llama", seed=7, layers=1, hidden=32))


def _lp(results):
    return [[(x.token, x.logprob, x.top) for x in r.logprobs] for r in results]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_same_however_the_tokens_were_made(pair, temperature):
    target, draft = pair
    kw = dict(temperature=temperature, seed=5, ignore_eos=True, logprobs=3)
    plain = [target.generate(p, 40, **kw) for p in PROMPTS]
    want = _lp(plain)
    assert all(len(w) == 40 for w in want) and all(r.token_ids == [t for t, _, _ in w] for r, w in zip(plain, want))
    for d, k in ((None, 0), ("lookup", 3), (draft, 4), (draft, "dynamic")):
        got = target.generate_batch(PROMPTS, 40, draft=d, num_draft_tokens=k or 4, **kw)
        assert _lp(got) == want, (d, k)
    K.set_num_threads(1)
    try:
        assert _lp(target.generate_batch(PROMPTS, 40, **kw)) == want
    finally:
        K.set_num_threads(2)
    scored = target.score_batch([(p, r.token_ids) for p, r in zip(PROMPTS, plain)], top=3)
    assert [[(x.token, x.logprob, x.top) for x in s] for s in scored] == want  # the teacher-forced pass
    assert [(x.token, x.logprob) for x in target.score(PROMPTS[1], plain[1].token_ids)] == \
        [(t, lp) for t, lp, _ in want[1]]


def test_logprobs_are_log_softmax_of_the_logits(pair):
    target, _ = pair
    r = target.generate(PROMPTS[0], 12, ignore_eos=True, logprobs=5)
    full = target.logits(PROMPTS[0] + r.token_ids)  # (n, V), one forward
    ref = torch.log_softmax(full.double(), -1)
    for i, x in enumerate(r.logprobs):
        row = ref[len(PROMPTS[0]) - 1 + i]
        assert math.isclose(x.logprob, float(row[x.token]), abs_tol=1e-5)
        assert x.logprob == x.top[0][1]  # greedy: the chosen token is a most likely one (twins may tie)
        assert all(a[1] >= b[1] for a, b in zip(x.top, x.top[1:]))
        assert [lp for _, lp in x.top] == sorted((float(v) for v in row.float().topk(5).values), reverse=True) or \
            all(math.isclose(lp, float(v), abs_tol=1e-5) for (_, lp), v in zip(x.top, row.topk(5).values))


def test_score_of_text_and_empty_and_errors(pair, ckpt):
    target, _ = pair
    m = exactspec.load(ckpt("qwen3"))
    ids = m.encode("def fibonacci(n):")
    assert m.score(ids, []) == []
    s = m.score("def", " fibonacci(n):")
    assert len(s) == len(m.tokenizer.encode(" fibonacci(n):", add_special_tokens=False))
    with pytest.raises(exactspec.InvalidRequest, match="prompt is empty"):
        m.score([], [3])
    with pytest.raises(exactspec.InvalidRequest, match="logprobs=21: at most 20"):
        m.generate([3], 2, logprobs=21)
    with pytest.raises(exactspec.ContextLengthError):
        exactspec.load(ckpt("qwen3"), max_context=8).score([3] * 6, [4] * 6)
    assert target.generate([3, 4], 3).logprobs is None  # off unless asked


def test_processed_logprobs_are_the_distribution_sampled_from_and_as_invariant(pair):
    target, draft = pair
    kw = dict(temperature=0.8, top_k=5, seed=2, ignore_eos=True, logprobs=8, logprobs_mode="processed")
    plain = target.generate_batch(PROMPTS, 30, **kw)
    want = _lp(plain)
    assert _lp(target.generate_batch(PROMPTS, 30, draft=draft, num_draft_tokens=3, **kw)) == want
    assert _lp(target.generate_batch(PROMPTS, 30, draft="lookup", num_draft_tokens="dynamic", **kw)) == want
    raw = target.generate_batch(PROMPTS, 30, **{**kw, "logprobs_mode": "raw"})
    assert [r.token_ids for r in raw] == [r.token_ids for r in plain]  # the mode changes reports, not tokens
    for r in plain:
        for x in r.logprobs:
            # top_k=5 (ties at the 5th value stay, as the sampler keeps them): fewer than the 8 asked
            assert len(x.top) < 8 and x.token in [t for t, _ in x.top]
            assert math.isclose(sum(math.exp(lp) for _, lp in x.top), 1.0, rel_tol=1e-5)
    with pytest.raises(exactspec.InvalidRequest, match="logprobs_mode='cooked'"):
        target.generate([3], 2, logprobs=1, logprobs_mode="cooked")


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_score_in_chunks_is_score(ckpt, chunk):
    m = exactspec.load(ckpt("llama"))
    ids = [(7 * i) % 200 + 3 for i in range(40)]
    for split in (1, 9):
        want = m.score(ids[:split], ids[split:], top=2)
        got = [x for part in m.score_steps(ids[:split], ids[split:], top=2, chunk=chunk) for x in part]
        assert [(x.token, x.logprob, x.top) for x in got] == [(x.token, x.logprob, x.top) for x in want]
