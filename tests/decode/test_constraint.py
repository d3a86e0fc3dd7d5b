"""Constrained decoding (decode/constraint.py): every answer stays inside its grammar, and every token,
logprob and finish reason is plain constrained decoding's (no drafts, a batch of one) whatever drafts
the forced text, the drafter or a prediction proposed, greedy or seeded, batched beside free requests."""
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import exactspec
from exactspec.decode import loop
from exactspec.decode.constraint import Matcher, masked
from exactspec.decode.sampling import SamplingParams, pick
from exactspec.errors import InvalidRequest

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["fox", "dog", "stack"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "minItems": 1, "maxItems": 3},
    "name": {"type": "string", "maxLength": 6},
    "ok": {"type": "boolean"}}, "required": ["kind", "n", "tags", "name", "ok"], "additionalProperties": False}
PROMPTS = [[5, 6, 7, 8], [100, 3, 100, 3, 9], list(range(20, 60))]


@pytest.fixture(scope="module")
def m(ckpt):
    return exactspec.load(ckpt("llama"))


def _answer(r) -> tuple:
    return r.token_ids, r.finish_reason, [(x.token, x.logprob, x.top) for x in r.logprobs or []]


def _valid(d: dict) -> None:
    assert set(d) == set(SCHEMA["properties"]) and d["kind"] in ("fox", "dog", "stack")
    assert 0 <= d["n"] <= 999 and 1 <= len(d["tags"]) <= 3 and len(d["name"]) <= 6 and isinstance(d["ok"], bool)


@pytest.mark.parametrize("temperature", [0.0, 1.3])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_constrained_answers_are_plain_constrained_decoding(m, temperature, mode, monkeypatch):
    monkeypatch.setattr(loop, "verify_costs", lambda net, context=32: np.ones(17))  # "auto": not a timing
    kw = dict(temperature=temperature, seed=[3, 4, 5], logprobs=2, logprobs_mode=mode)
    plain = [m.generate(p, 90, json_schema=SCHEMA, num_draft_tokens=0, temperature=temperature, seed=s, logprobs=2,
                        logprobs_mode=mode) for p, s in zip(PROMPTS, kw["seed"])]
    for r in plain:
        assert r.finish_reason == "stop" and r.stats.forward_passes == len(r.token_ids)  # no drafts at k = 0
        _valid(json.loads(r.text))
    want = [_answer(r) for r in plain]
    free = _answer(m.generate(PROMPTS[1], 90, temperature=temperature, seed=4, logprobs=2, logprobs_mode=mode))
    runs = {"forced": {}, "forced k=3": dict(num_draft_tokens=3), "lookup": dict(draft="lookup"),
            "lookup k=8": dict(draft="lookup", num_draft_tokens=8), "pool": dict(draft="pool"),
            "prediction": dict(prediction=[r.text for r in plain]),
            "wrong prediction": dict(prediction='{"kind": "dog", "n": 7, "tags": ["a"]}')}
    for name, extra in runs.items():
        got = m.generate_batch(PROMPTS, 90, json_schema=SCHEMA, **kw, **extra)
        assert [_answer(r) for r in got] == want, name
        # mixed with a free request (the same batch, the same slot numbers shuffled)
        extra = {k: v[:2][::-1] if k == "prediction" else v for k, v in extra.items()}
        mix = m.generate_batch([PROMPTS[1], PROMPTS[0]], 90, json_schema=[None, SCHEMA], temperature=temperature,
                               seed=[4, 3], logprobs=2, logprobs_mode=mode, **extra)
        assert _answer(mix[1]) == want[0] and _answer(mix[0]) == free, name
    fast = m.generate_batch(PROMPTS, 90, json_schema=SCHEMA, **kw)
    assert sum(r.stats.forward_passes for r in fast) < 0.7 * sum(r.stats.forward_passes for r in plain)


def test_forced_text_with_another_split_keeps_the_models(m):
    """Choices whose text the vocabulary splits several ways: the forced tokens are llguidance's split, the
    model's sampled split may differ; the answer is always the model's (plain decoding's)."""
    words = ["the quick brown fox", "the quick brown dog", "def fibonacci(n):"]
    other = 0
    for seed in range(12):
        plain = m.generate(PROMPTS[seed % 3], 40, choice=words, num_draft_tokens=0, temperature=1.5, seed=seed)
        fast = m.generate(PROMPTS[seed % 3], 40, choice=words, temperature=1.5, seed=seed, draft="lookup")
        assert fast.token_ids == plain.token_ids and fast.text in words and fast.finish_reason == "stop"
        other += plain.token_ids != m.tokenizer.encode(plain.text, add_special_tokens=False)
    assert other, "no answer took a split other than the tokenizer's: the test proves nothing"


def test_the_masked_pick_is_the_best_allowed_token(m):
    g = m.constraint("regex", r"(ab|cd)[0-9]{2,4}")
    rng = np.random.default_rng(0)
    for trial in range(20):
        mt = Matcher(g)
        mt.advance(m.tokenizer.encode("ab", add_special_tokens=False))
        allowed = mt.mask()
        row = torch.from_numpy(rng.standard_normal(m.cfg.vocab_size).astype(np.float32))
        want = int(np.flatnonzero(allowed)[np.argmax(row.numpy()[allowed])])
        assert pick(masked(row, allowed), SamplingParams(), 0, []) == want
        t = pick(masked(row, allowed), SamplingParams(temperature=2.0, seed=trial), 5, [])
        assert allowed[t]


def test_length_ends_with_a_valid_prefix_and_errors_name_the_field(m):
    r = m.generate(PROMPTS[0], 5, json_schema=SCHEMA)
    assert r.finish_reason == "length" and len(r.token_ids) == 5
    mt = Matcher(m.constraint("json_schema", SCHEMA))
    mt.advance(r.token_ids)  # raises if the prefix left the grammar
    for kw, field in ((dict(json_schema={"type": "object", "properties": {"a": {"type": "strin"}}}), "json_schema"),
                      (dict(json_schema="{not json"), "json_schema"), (dict(grammar="root ::= missing"), "grammar"),
                      (dict(grammar="start: (("), "grammar"), (dict(regex="(unclosed"), "regex"),
                      (dict(choice=[]), "choice"), (dict(choice=["a", 3]), "choice"),
                      (dict(regex="a", choice=["a"]), "regex")):
        with pytest.raises(InvalidRequest) as e:
            m.generate(PROMPTS[0], 5, **kw)
        assert e.value.field == field, kw


@pytest.mark.parametrize("kw,field,needle", [
    (dict(grammar="root ::= root"), "grammar", "allows no text"),
    (dict(json_schema={"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}),
     "json_schema", "allows no text"),
    (dict(grammar='root ::= "a" root'), "grammar", "Too many items"),
    (dict(grammar='root ::= "a"{1000000}'), "grammar", "Too many items"),
    (dict(grammar="root ::= " + " | ".join(f'"x{i}"' for i in range(30000))), "grammar", "at most 262144"),
    (dict(regex="a" * 300000), "regex", "at most 262144")])
def test_a_constraint_the_matcher_cannot_follow_is_refused_before_decoding(m, kw, field, needle):
    """Checked at the boundary (the first step run on a probe matcher): a named InvalidRequest, never a
    GenerationError from inside the decode loop."""
    with pytest.raises(InvalidRequest, match=needle) as e:
        m.generate(PROMPTS[0], 5, **kw)
    assert e.value.field == field


def test_a_choice_of_thousands_of_strings_is_one_of_them(m):
    words = [f"w{i}" for i in range(5000)]
    r = m.generate(PROMPTS[0], 12, choice=words, draft="lookup")
    assert r.text in words and r.finish_reason == "stop"
    assert r.token_ids == m.generate(PROMPTS[0], 12, choice=words, num_draft_tokens=0).token_ids


def test_gbnf_lark_pydantic_and_per_prompt_constraints(m):
    from pydantic import BaseModel

    class Pet(BaseModel):
        kind: str
        legs: int
    gbnf = m.generate(PROMPTS[0], 20, grammar='root ::= "yes" | "no" | "maybe"')
    lark = m.generate(PROMPTS[0], 20, grammar='start: "yes" | "no" | "maybe"')
    assert gbnf.text in ("yes", "no", "maybe") and gbnf.token_ids == lark.token_ids
    pet = m.generate(PROMPTS[1], 60, json_schema=Pet)
    if pet.finish_reason == "stop":
        Pet.model_validate_json(pet.text)
    both = m.generate_batch(PROMPTS[:2], 20, choice=[["x1", "y2"], None], ignore_eos=True)
    assert both[0].text in ("x1", "y2") and both[1].finish_reason == "length"


def test_one_thread_or_two_the_same_constrained_answer(m):
    from exactspec import set_num_threads
    from exactspec.kernels.threads import get_num_threads
    n = get_num_threads()
    kw = dict(json_schema=SCHEMA, temperature=1.3, seed=[3, 4, 5], logprobs=2, draft="lookup")
    two = [_answer(r) for r in m.generate_batch(PROMPTS, 90, **kw)]
    set_num_threads(1)
    try:
        one = [_answer(r) for r in m.generate_batch(PROMPTS, 90, **kw)]
    finally:
        set_num_threads(n)
    assert one == two


_leaf = st.one_of(st.lists(st.sampled_from(["a", "bb", "fox", "x y", "7"]), min_size=1, max_size=3, unique=True)
                  .map(lambda e: {"enum": e}),
                  st.tuples(st.integers(-50, 50), st.integers(0, 300)).map(
                      lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
                  st.just({"type": "boolean"}),
                  st.integers(1, 4).map(lambda n: {"type": "string", "maxLength": n}))
_schemas = st.recursive(_leaf, lambda inner: st.one_of(
    st.dictionaries(st.sampled_from(["k", "name", "n", "deep"]), inner, min_size=1, max_size=3).map(
        lambda p: {"type": "object", "properties": p, "required": sorted(p), "additionalProperties": False}),
    st.tuples(inner, st.integers(1, 3)).map(lambda t: {"type": "array", "items": t[0], "minItems": 1,
                                                       "maxItems": t[1]})), max_leaves=5)


def _follows(v, s) -> bool:
    """v is valid under s (the subset _schemas makes), checked by hand: no validator needed."""
    if "enum" in s:
        return v in s["enum"]
    t = s["type"]
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool) and s["minimum"] <= v <= s["maximum"]
    if t == "boolean":
        return isinstance(v, bool)
    if t == "string":
        return isinstance(v, str) and len(v) <= s["maxLength"]
    if t == "array":
        return isinstance(v, list) and 1 <= len(v) <= s["maxItems"] and all(_follows(x, s["items"]) for x in v)
    return isinstance(v, dict) and set(v) == set(s["properties"]) and all(_follows(v[k], s["properties"][k])
                                                                          for k in v)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas, seed=st.integers(0, 3))
def test_random_schemas_valid_answers_every_drafter_the_same(m, schema, seed):
    kw = dict(json_schema=schema, temperature=1.0, seed=seed, logprobs=1)
    plain = m.generate(PROMPTS[seed % 3], 120, num_draft_tokens=0, **kw)
    for extra in ({}, {"draft": "lookup", "num_draft_tokens": 8}):
        assert _answer(m.generate(PROMPTS[seed % 3], 120, **kw, **extra)) == _answer(plain), extra
    if plain.finish_reason == "stop":
        assert _follows(json.loads(plain.text), schema), (plain.text, schema)


def test_a_grammar_with_no_allowed_token_left_is_a_named_error_for_that_answer_alone(m, monkeypatch):
    """A vocabulary that cannot spell what the grammar needs next (here: no digits) leaves no allowed token:
    llguidance stops, and the matcher raises a one-line GenerationError, never an unconstrained pick. In a
    batch the dead end fails its own answer only; the other answers are their plain selves."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from exactspec.decode import constraint as C
    from exactspec.errors import GenerationError
    vocab = {c: i for i, c in enumerate(["<eos>", *"abcdefghij", "ab"])}
    t = Tokenizer(models.BPE(vocab, [("a", "b")]))
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    mt = C.Matcher(C.make_grammar(C.Vocab(t.to_str(), len(vocab), [0]), "regex", "ab[0-9]"))
    assert mt.mask().nonzero()[0].tolist() == [11]  # "ab" (llguidance keeps to the canonical split)
    mt.advance([11])
    with pytest.raises(GenerationError, match=r"^regex: the matcher cannot follow the constraint \(computing the "
                                              r"allowed tokens\): \S+$"):
        mt.mask()
    # in the decode loop: one answer's matcher reaches a dead end at its 4th token
    want = [m.generate(p, 20, ignore_eos=True).token_ids for p in PROMPTS[:2]]
    real, calls = C.Matcher.mask, {"n": 0}

    def dead_end(self):
        calls["n"] += 1
        if calls["n"] == 4:
            raise GenerationError("constraint (regex): computing the allowed tokens: NoExtensionBias")
        return real(self)
    monkeypatch.setattr(C.Matcher, "mask", dead_end)
    with pytest.raises(GenerationError, match=r"NoExtensionBias") as e:
        m.generate_batch(PROMPTS[:3], 20, ignore_eos=True, regex=[None, None, "[a-z ]+"], num_draft_tokens=0)
    got = e.value.results
    assert [r.finish_reason for r in got] == ["length", "length", "error"]
    assert [r.token_ids for r in got[:2]] == want
