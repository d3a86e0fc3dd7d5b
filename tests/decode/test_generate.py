"""Greedy generation against a slow no-cache reference; stops; batches; API shapes."""
import pytest
import torch

import exactspec


def _reference_greedy(model, ids, n):
    """nanochat-style reference: re-run the whole sequence without a cache for every token."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model.logits(seq)[-1].argmax()))
    return seq[len(ids):]


def test_greedy_220_tokens_equals_stepwise_argmax_of_no_cache_logits(ckpt):
    model = exactspec.load(ckpt("llama"))
    ids = [5, 17, 200, 33, 9, 41]
    r = model.generate(ids, max_new_tokens=220, ignore_eos=True)
    assert len(r.token_ids) == 220 and r.finish_reason == "length"
    assert r.token_ids == _reference_greedy(model, ids, 220)
    assert r.stats.forward_passes == 220 and r.stats.tokens_per_second > 0


def test_bfloat16_greedy_equals_reference(ckpt):
    model = exactspec.load(ckpt("qwen2"), dtype="bfloat16")
    ids = [7, 8, 9, 10]
    r = model.generate(ids, max_new_tokens=60, ignore_eos=True)
    assert r.token_ids == _reference_greedy(model, ids, 60)


def test_eos_stops_and_ignore_eos_does_not(ckpt):
    model = exactspec.load(ckpt("llama"))
    ids = [3, 4, 5]
    free = model.generate(ids, max_new_tokens=40, ignore_eos=True).token_ids
    stop = free[15]
    first = free.index(stop)
    model.eos_token_ids = (stop,)
    r = model.generate(ids, max_new_tokens=40)
    assert r.token_ids == free[: first + 1] and r.finish_reason == "stop"
    assert model.generate(ids, max_new_tokens=40, ignore_eos=True).token_ids == free


def test_batch_of_different_lengths_equals_each_alone(ckpt):
    model = exactspec.load(ckpt("mistral"))
    prompts = [[5], list(range(10, 60)), [9, 8, 7, 6, 5, 4, 3], "def fibonacci(n):"]
    alone = [model.generate(p, max_new_tokens=50, ignore_eos=True).token_ids for p in prompts]
    batch = model.generate_batch(prompts, max_new_tokens=50, ignore_eos=True)
    assert [r.token_ids for r in batch] == alone


def test_text_prompt_and_streaming(ckpt):
    model = exactspec.load(ckpt("qwen3"))
    pieces = []
    r = model.generate("class Stack:", max_new_tokens=30, ignore_eos=True, on_text=pieces.append)
    assert r.text == model.decode(r.token_ids)
    assert "".join(pieces) == r.text
    assert model.encode("class Stack:") == model.tokenizer.encode("class Stack:")


def test_zero_new_tokens(ckpt):
    model = exactspec.load(ckpt("llama"))
    r = model.generate([1, 2, 3], max_new_tokens=0)
    assert r.token_ids == [] and r.finish_reason == "length"


def test_context_end_stops_with_length(ckpt):
    model = exactspec.load(ckpt("llama"), max_context=40)
    r = model.generate(list(range(2, 32)), max_new_tokens=None, ignore_eos=True)  # None: up to the context
    assert len(r.token_ids) == 10 and r.finish_reason == "length"
    with pytest.raises(exactspec.ContextLengthError, match=r"maximum context length is 40 .* \(30 in the prompt \+ 100 new"):
        model.generate(list(range(2, 32)), max_new_tokens=100, ignore_eos=True)
    full = exactspec.load(ckpt("llama")).generate(list(range(2, 32)), max_new_tokens=10, ignore_eos=True)
    assert r.token_ids == full.token_ids


def test_logits_shape_and_empty(ckpt):
    model = exactspec.load(ckpt("qwen2"))
    assert model.logits([4, 5, 6]).shape == (3, 320)
    assert model.logits([]).shape == (0, 320)
    assert torch.equal(model.logits([4, 5, 6])[:2], model.logits([4, 5]))


def test_greedy_repetition_penalty_fast_path_equals_filtered_logits():
    """pick's greedy + penalty path (numpy, history tokens only) == argmax of filtered_logits."""
    import random
    from exactspec.decode import sampling as S
    g = torch.Generator().manual_seed(0)
    rnd = random.Random(0)
    for trial in range(600):
        V = rnd.choice([50, 320, 4096])
        z = torch.randn(V, generator=g) * 3
        if trial % 3 == 0:
            z = z.round()  # exact ties: the first index wins in both
        hist = [rnd.randrange(V + 5) for _ in range(rnd.randrange(0, 60))]  # ids >= V are ignored
        rp = rnd.choice([1.1, 1.2, 1.3, 2.0, 0.9])
        want = int(torch.argmax(S.filtered_logits(z, S.SamplingParams(1.0, repetition_penalty=rp), hist)))
        assert S.pick(z, S.SamplingParams(0.0, repetition_penalty=rp), 0, hist) == want, trial


def test_seed_none_greedy_ignores_it_and_sampling_reports_a_fresh_one(ckpt):
    m = exactspec.load(ckpt("llama"))
    greedy = m.generate("def f(x):", 12, ignore_eos=True)
    assert m.generate("def f(x):", 12, ignore_eos=True, seed=None).token_ids == greedy.token_ids
    a = m.generate("def f(x):", 24, ignore_eos=True, temperature=1.0, seed=None)
    b = m.generate("def f(x):", 24, ignore_eos=True, temperature=1.0, seed=None)
    assert isinstance(a.stats.seed, int) and a.stats.seed != b.stats.seed
    replay = m.generate("def f(x):", 24, ignore_eos=True, temperature=1.0, seed=a.stats.seed, draft="lookup")
    assert replay.token_ids == a.token_ids and replay.stats.seed == a.stats.seed


class _FailsOn:
    """The target, but a forward holding a row of a sequence in `slots` past its prompt's first new
    token (position > `prompt_len`) raises, as a kernel failure would. Fault injection by wrapping:
    production code has no hook for it."""

    def __init__(self, net, slots: set[int], prompt_len: int):
        self.net, self.slots, self.prompt_len = net, slots, prompt_len

    def __getattr__(self, name):
        return getattr(self.net, name)

    def forward(self, tokens, slot, pos, *args, **kw):
        if any(s in self.slots and p > self.prompt_len for s, p in zip(slot.tolist(), pos.tolist())):
            raise RuntimeError("injected")
        return self.net.forward(tokens, slot, pos, *args, **kw)


def test_a_failure_inside_decoding_raises_never_a_short_result(ckpt):
    """generate / generate_batch raise GenerationError when the loop fails a sequence (it used to
    return the tokens made so far with finish_reason "error"); the batch's other results, attached
    to the error, equal their solo runs."""
    model = exactspec.load(ckpt("llama"))
    good, bad = [5, 17, 200], [9, 9, 41, 2]
    want = model.generate(good, 12, ignore_eos=True).token_ids
    net = model.net
    model.net = wrapper = _FailsOn(net, {0}, len(bad))  # generate: the one sequence sits in slot 0
    try:
        with pytest.raises(exactspec.GenerationError, match=r"prompt: decoding failed after \d+ tokens") as e:
            model.generate(bad, 12, ignore_eos=True)
        assert e.value.results[0].finish_reason == "error"
        wrapper.slots = {1}  # generate_batch: prompt i in slot i
        with pytest.raises(exactspec.GenerationError, match="prompt 1: decoding failed") as e:
            model.generate_batch([good, bad], 12, ignore_eos=True)
        ok, failed = e.value.results
        assert ok.token_ids == want and ok.finish_reason == "length" and failed.finish_reason == "error"
    finally:
        model.net = net
