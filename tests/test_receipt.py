"""Receipts: an answer made with any drafter verifies by plain decoding; an altered one fails at the
position altered; the numerics version follows the kernels' golden record."""
import hashlib
import json
import re
from pathlib import Path
from typing import Literal, Optional

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import exactspec
from exactspec import receipt
from exactspec.cli import main

GOLDEN = Path(__file__).parent / "kernels" / "golden.json"


def test_the_numerics_version_names_the_golden_record():
    """Change the golden record and this fails until NUMERICS_VERSION is bumped with its new sha256."""
    digest = hashlib.sha256(GOLDEN.read_bytes()).hexdigest()
    assert receipt.GOLDEN_SHA256[receipt.NUMERICS_VERSION] == digest, \
        "tests/kernels/golden.json changed: bump receipt.NUMERICS_VERSION and add its sha256 to GOLDEN_SHA256"
    assert sorted(receipt.GOLDEN_SHA256) == list(range(1, receipt.NUMERICS_VERSION + 1))
    assert len(set(receipt.GOLDEN_SHA256.values())) == len(receipt.GOLDEN_SHA256)


def test_a_compatible_version_is_one_whose_records_are_all_kept():
    """A version listed in COMPATIBLE: its frozen record (golden_vN.json, checked by its sha256) is contained,
    value for value, in today's; so every model it covered computes today what it computed then."""
    now = json.loads(GOLDEN.read_text())
    for v in receipt.COMPATIBLE:
        frozen = GOLDEN.with_name(f"golden_v{v}.json").read_bytes()
        assert hashlib.sha256(frozen).hexdigest() == receipt.GOLDEN_SHA256[v], v
        old = json.loads(frozen)
        assert {k: now.get(k) for k in old} == old, f"version {v}'s records changed: remove it from COMPATIBLE"


@pytest.fixture(scope="module")
def model(ckpt):
    return exactspec.load(ckpt("llama"))


@pytest.mark.parametrize("kw", [{}, {"draft": "lookup", "num_draft_tokens": 4},
                                {"temperature": 0.9, "seed": 11, "draft": "lookup"},
                                {"temperature": 0.7, "seed": None, "top_p": 0.9},
                                {"json_schema": {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}},
                                                 "required": ["a"]}, "draft": "lookup"},
                                {"choice": ["fox", "dog"], "temperature": 1.5, "seed": 2},
                                {"regex": "[0-9]{3,9}", "temperature": 1.5, "seed": 2},
                                {"grammar": 'root ::= "yes" | "no"'}])
def test_a_receipt_verifies_by_plain_decoding(model, kw):
    r = model.generate([5, 6, 7, 8, 5, 6, 7], 24, ignore_eos=True, **kw)
    rec = json.loads(json.dumps(r.receipt()))  # through JSON, as it is kept
    assert rec["choices"][0]["token_ids"] == r.token_ids and rec["choices"][0]["seed"] == r.request.params.seed
    assert rec["model"]["sha256"] == receipt.model_sha256(model.folder)
    v = receipt.verify(model, rec)
    assert v.identical and v.first_difference == [None], v.problems


class _Inner(pydantic.BaseModel):
    zeta: int
    alpha: Literal["b", "a"]


class _Person(pydantic.BaseModel):  # fields out of alphabetical order, nested, optional, an enum
    name: str
    age: int
    where: Optional[_Inner] = None
    tags: list[Literal["z", "y"]] = []


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"z": {"type": "object", "properties": {"b": {"const": 1}, "a": {"const": 2}},
                                            "required": ["b", "a"]}, "y": {"enum": ["q", "p"]}},
     "required": ["z", "y"]},
    _Person, _Inner])
def test_a_json_schema_receipt_verifies_in_the_callers_key_order(model, schema):
    """The answer writes properties in the caller's order; the receipt keeps the schema text that was
    compiled, so the replay writes them in that order too (it stored them sorted: 'differs at 1')."""
    r = model.generate([5, 6, 7, 8], 40, json_schema=schema, draft="lookup")
    first = (schema.model_json_schema() if isinstance(schema, type) else schema)["required"][0]
    assert r.text.startswith('{"' + first), r.text
    rec = json.loads(json.dumps(r.receipt()))
    v = receipt.verify(model, rec)
    assert v.identical, v.problems


def test_a_tampered_receipt_fails_at_the_position_tampered(model):
    r = model.generate([5, 6, 7, 8], 20, ignore_eos=True, draft="lookup")
    rec = r.receipt()
    bad = json.loads(json.dumps(rec))
    bad["choices"][0]["token_ids"][13] = (bad["choices"][0]["token_ids"][13] + 1) % model.cfg.vocab_size
    v = receipt.verify(model, bad)
    assert not v.identical and v.first_difference == [13]
    assert any("sha256 does not match" in p for p in v.problems)
    assert any("differs at output position 13" in p for p in v.problems)
    resealed = json.loads(json.dumps(bad))  # a forger who fixes the sha256 too: the replay still says 13
    resealed["choices"][0]["sha256"] = receipt.ids_sha256(resealed["choices"][0]["token_ids"])
    assert receipt.verify(model, resealed).first_difference == [13]
    other = json.loads(json.dumps(rec))
    other["request"]["temperature"] = 0.5  # another request: another answer
    assert not receipt.verify(model, other).identical
    other = json.loads(json.dumps(rec))
    other["model"]["sha256"] = "0" * 64
    assert any(p.startswith("model sha256") for p in receipt.verify(model, other).problems)
    for version, ok in ((1, True), (receipt.NUMERICS_VERSION, True), (receipt.NUMERICS_VERSION + 1, False), (0, False)):
        other = json.loads(json.dumps(rec))  # a compatible earlier version replays; another one is named
        other["numerics"] = version
        v = receipt.verify(model, other)
        assert v.identical == ok and any(p.startswith("numerics version") for p in v.problems) != ok, version


def test_the_cli_writes_and_verifies_receipts(ckpt, tmp_path, capsys):
    folder = ckpt("llama")
    out = tmp_path / "r.json"
    assert main(["generate", "--model", str(folder), "--prompt", "def f(x):", "--max-new-tokens", "12",
                 "--draft", "lookup", "--temperature", "0.8", "--seed", "4", "--receipt", str(out), "--json"]) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--model", str(folder)]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True
    rec = json.loads(out.read_text())
    rec["choices"][0]["token_ids"][5] += 1
    out.write_text(json.dumps(rec))
    assert main(["verify", str(out), "--model", str(folder)]) == 1
    assert json.loads(capsys.readouterr().out)["first_difference"] == [5]
    out.write_text("{not json")
    assert main(["verify", str(out), "--model", str(folder)]) == 2
    assert "not a readable receipt" in capsys.readouterr().err


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r.pop("choices"), "has no 'choices'"),
    (lambda r: r.update(choices=[]), "choices is []: must be a non-empty list"),
    (lambda r: r["choices"][0].update(token_ids=["a"]), "choices[0].token_ids[0] is 'a'"),
    (lambda r: r["choices"][0].update(token_ids=[[1, 2]]), "choices[0].token_ids[0] is [1, 2]"),
    (lambda r: r["choices"][0].update(token_ids=[None, 1]), "choices[0].token_ids[0] is None"),
    (lambda r: r["choices"][0].update(token_ids=[5.0]), "choices[0].token_ids[0] is 5.0"),
    (lambda r: r["model"]["load"].update(kv_dtype=["a"]), "model.load.kv_dtype is ['a']"),
    (lambda r: r["model"].update(kv_dtype=["a"]), "model.kv_dtype is ['a']"),
    (lambda r: r["request"].update(stop=[""]), "request.stop is ['']"),
    (lambda r: r["request"].update(eos=[10 ** 40]), "request.eos[0] is 1000000000000000000000000000000000000000"),
    (lambda r: r["request"].update(top_k=10 ** 30), "request.top_k is 1000000000000000000000000000000"),
    (lambda r: r["request"].update(temperature=True), "request.temperature is True"),
    (lambda r: r["request"].update(constraint={"kind": "yaml", "source": "x"}), "request.constraint.kind is 'yaml'"),
    (lambda r: r["choices"][0].update(finish_reason=7), "choices[0].finish_reason is 7"),
    (lambda r: r.update(request=[]), "request is []: must be an object"),
])
def test_a_malformed_receipt_is_one_named_line_and_exit_2(ckpt, model, tmp_path, capsys, edit, needle):
    rec = json.loads(json.dumps(model.generate([5, 6, 7], 6, ignore_eos=True).receipt()))
    edit(rec)
    f = tmp_path / "r.json"
    f.write_text(json.dumps(rec))
    assert main(["verify", str(f), "--model", str(ckpt("llama"))]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(exactspec.InvalidRequest, match=re.escape(needle)):
        receipt.verify(model, rec)


def test_a_receipt_nested_too_deeply_is_exit_2(ckpt, tmp_path, capsys):
    f = tmp_path / "r.json"
    f.write_text('{"receipt": ' + _deep(100000) + "}")
    assert main(["verify", str(f), "--model", str(ckpt("llama"))]) == 2
    assert "not a readable receipt" in capsys.readouterr().err


def test_another_models_receipt_says_the_model_differs_before_the_replay_error(model):
    rec = json.loads(json.dumps(model.generate([5, 6, 7], 6, ignore_eos=True).receipt()))
    rec["model"]["sha256"] = "0" * 64  # made on a model with a larger vocabulary
    rec["request"]["prompt_ids"][1] = model.cfg.vocab_size + 100
    with pytest.raises(exactspec.InvalidRequest) as e:
        receipt.verify(model, rec)
    msg = str(e.value)
    assert msg.index("model sha256") < msg.index("outside the vocabulary"), msg


def test_a_replay_that_fails_says_its_error(model, monkeypatch):
    from exactspec.decode import constraint as C
    from exactspec.errors import ConstraintError
    rec = json.loads(json.dumps(model.generate([5, 6, 7], 8, regex="[a-z ]+", num_draft_tokens=0).receipt()))
    real, calls = C.Matcher.mask, {"n": 0}

    def dead_end(self):
        calls["n"] += 1
        if calls["n"] == 5:  # the probe's mask, then the replay's 4th
            raise ConstraintError("regex: the matcher cannot follow the constraint (test)", "regex")
        return real(self)
    monkeypatch.setattr(C.Matcher, "mask", dead_end)
    v = receipt.verify(model, rec)
    assert not v.identical and any("the replay failed after 3 tokens (ConstraintError: regex: the matcher" in p
                                   for p in v.problems), v.problems


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
                     max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([("receipt",), ("numerics",), ("model",), ("model", "sha256"), ("model", "load"),
                             ("request",), ("request", "prompt_ids"), ("request", "max_new_tokens"),
                             ("request", "top_p"), ("request", "eos"), ("request", "stop"), ("request", "constraint"),
                             ("choices",), ("choices", 0), ("choices", 0, "seed"), ("choices", 0, "token_ids")]),
       value=_JSON)
def test_fuzzed_receipts_verify_or_are_named(model, path, value):
    """Any value anywhere: a Verdict or an InvalidRequest naming the receipt, never another exception."""
    rec = json.loads(json.dumps(_SMALL[0]))
    at = rec
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    try:
        receipt.verify(model, rec)
    except exactspec.InvalidRequest as e:
        assert e.field in ("receipt", "receipt.request.constraint", "prompt", "eos", "max_new_tokens") or \
            str(e).startswith("receipt"), e


@pytest.fixture(scope="module", autouse=True)
def _small(model):
    _SMALL[:] = [model.generate([5, 6, 7], 4, ignore_eos=True).receipt()]


_SMALL: list = []
