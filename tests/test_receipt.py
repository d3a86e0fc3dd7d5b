"""Receipts: an answer made with any drafter verifies by plain decoding; an altered one fails at the
position altered; the numerics version follows the kernels' golden record."""
import hashlib
import json
from pathlib import Path
from typing import Literal, Optional

import pydantic
import pytest

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
