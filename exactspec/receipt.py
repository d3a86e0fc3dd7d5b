"""Receipts: any answer checkable later, by anyone.

The promise (the same bits for the same request on any replica, CPU, drafter, batch or thread count)
makes an answer verifiable after the fact: replay its request by plain decoding (no drafter, a batch
of one) on the same model file with the same numerics, and the tokens must be the same. A receipt
holds what that replay needs and what it must find:

    model       the file's sha256 (a folder: of its weights and config files), the tokenizer's and the
                chat template's sha256, the load settings (dtype, quantize, activations, kv_dtype)
    numerics    NUMERICS_VERSION: the kernels' arithmetic, tied to their golden record
    request     prompt token ids, sampling parameters, max_new_tokens, EOS ids, stop strings, the constraint
                (its kind and source: a JSON schema, grammar, regex or choice list), if any
    choices     per answer: its resolved seed, output token ids, their sha256, the finish reason

`make` writes one, `verify` replays one. The library (`GenerationResult.receipt()`), the CLI
(`generate --receipt FILE`, `exactspec verify RECEIPT --model FILE`) and the server (`"receipt": true`)
use these two.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .decode.constraint import KINDS
from .decode.loop import run_batch
from .decode.request import Request, make_request
from .decode.sampling import SamplingParams
from .errors import InvalidRequest
from .text.stream import tokens_through_stop

FORMAT = "exactspec-receipt/1"
# The version of the kernels' arithmetic. Bump it with every change to their golden record
# (tests/kernels/golden.json), and add its sha256 here: tests/test_receipt.py fails otherwise.
NUMERICS_VERSION = 2
GOLDEN_SHA256 = {  # version -> the golden record's sha256 (append-only)
    1: "d93774562957b2c52fee38b62baeb3f06c5988f7366188f39e5b247676a4b195",
    2: "4e0d189283ee9763adf112c01f4203243bc278693b43a00df44e3d1cb5246b9f",  # + Gemma 3, Qwen3-MoE models
}
# Earlier versions whose every record this version reproduces unchanged (it only added records: new
# architectures): their receipts replay here. tests/test_receipt.py proves it from their frozen records
# (tests/kernels/golden_vN.json); a change to an existing record leaves this empty.
COMPATIBLE = (1,)
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json")


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "exactspec" / "sha256.json"


def file_sha256(path: Path) -> str:
    """A file's sha256, cached by its resolved path, size and mtime (a 4 GB file hashes in ~10 s)."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    cache = _cache_file()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        known = known if isinstance(known, dict) else {}
        known[key] = digest
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)
    except OSError:  # a read-only home: hash again next time
        pass
    return digest


def model_sha256(source: Path) -> str:
    """A GGUF file's sha256; a checkpoint folder's: of the lines "name sha256" of its weight and
    config files, sorted by name."""
    source = Path(source)
    if source.is_file():
        return file_sha256(source)
    files = sorted({p for pat in _WEIGHT_FILES for p in source.glob(pat)})
    return hashlib.sha256("".join(f"{p.name} {file_sha256(p)}\n" for p in files).encode()).hexdigest()


def ids_sha256(ids: Sequence[int]) -> str:
    """The sha256 of token ids written as decimal numbers joined by commas ("1,2,3")."""
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


def _text_sha256(s: str | None) -> str | None:
    return hashlib.sha256(s.encode()).hexdigest() if s is not None else None


def model_facts(model: Any) -> dict:
    """What a receipt says of a loaded Model (memoized on it: the file is hashed once)."""
    facts = getattr(model, "_receipt_facts", None)
    if facts is None:
        tok = model.tokenizer
        template = tok.config.get("chat_template") if tok is not None else None
        facts = {"sha256": model_sha256(model.folder), "name": Path(model.folder).name,
                 "tokenizer_sha256": _text_sha256(tok.tok.to_str()) if tok is not None else None,
                 "chat_template_sha256": _text_sha256(template if isinstance(template, str) else None),
                 "load": dict(getattr(model, "load_args", {}) or {}),
                 "weights": model.net.dtype, "activations": model.net.activations,
                 "kv_dtype": model.net.kv_dtype}
        model._receipt_facts = facts
    return facts


def make(model: Any, req: Request, choices: Sequence[tuple[int | None, Sequence[int], str]]) -> dict:
    """A receipt for answers to `req` on `model`: choices as (seed, output token ids, finish reason)."""
    p = req.params
    return {"receipt": FORMAT, "numerics": NUMERICS_VERSION, "model": model_facts(model),
            "request": {"prompt_ids": list(req.prompt), "temperature": p.temperature, "top_k": p.top_k,
                        "top_p": p.top_p, "min_p": p.min_p, "repetition_penalty": p.repetition_penalty,
                        "max_new_tokens": req.max_new_tokens, "eos": sorted(req.eos), "stop": list(req.stop),
                        **({"constraint": {"kind": req.constraint.kind, "source": req.constraint.source}}
                           if req.constraint is not None else {})},
            "choices": [{"seed": seed, "token_ids": [int(t) for t in ids], "sha256": ids_sha256(ids),
                         "finish_reason": finish} for seed, ids, finish in choices]}


@dataclass
class Verdict:
    identical: bool
    problems: list[str]  # each a sentence: where the replay or the receipt disagrees
    first_difference: list[int | None]  # per choice: the first position whose token differs (None: same)

    def as_dict(self) -> dict:
        return {"identical": self.identical, "problems": self.problems, "first_difference": self.first_difference}


FINISH_REASONS = ("stop", "length", "tool_calls", "error")
_HEX64 = "0123456789abcdef"


def _bad(where: str, v: Any, rule: str) -> InvalidRequest:
    r = repr(v)
    return InvalidRequest(f"receipt: {where} is {r[:80] + '...' if len(r) > 80 else r}: {rule}", "receipt")


def _int(v: Any, where: str, lo: int = 0, hi: int = 2 ** 31) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
        raise _bad(where, v, f"must be an integer in [{lo}, {hi})")
    return v


def _number(v: Any, where: str, ok, rule: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
        raise _bad(where, v, rule)
    return v


def _text(v: Any, where: str, none: bool = False) -> str | None:
    if v is None and none:
        return None
    if not isinstance(v, str):
        raise _bad(where, v, "must be a string" + (" or null" if none else ""))
    return v


def _ids(v: Any, where: str, empty: bool = True) -> list[int]:
    if not isinstance(v, list) or not v and not empty:
        raise _bad(where, v, "must be a " + ("" if empty else "non-empty ") + "list of token ids")
    return [_int(t, f"{where}[{i}]") for i, t in enumerate(v)]


def _object(v: Any, where: str, required: Sequence[str]) -> dict:
    if not isinstance(v, dict):
        raise _bad(where, v, "must be an object")
    missing = [k for k in required if k not in v]
    if missing:
        raise InvalidRequest(f"receipt: {where} has no {', '.join(repr(k) for k in missing)}", "receipt")
    return v


def check(rec: Any) -> None:
    """The receipt's form, strictly, before anything is replayed: every field present with its type and
    range (the values a request may have: what the server refuses, a receipt may not hold), at least one
    choice. InvalidRequest naming the first field that is not."""
    if not isinstance(rec, dict) or rec.get("receipt") != FORMAT:
        raise InvalidRequest(f"receipt: not an exactspec receipt (expected \"receipt\": {FORMAT!r})", "receipt")
    _object(rec, "the receipt", ("numerics", "model", "request", "choices"))
    _int(rec["numerics"], "numerics")
    m = _object(rec["model"], "model", ("sha256", "tokenizer_sha256", "weights", "activations", "kv_dtype"))
    for k in ("sha256", "tokenizer_sha256", "chat_template_sha256"):
        if k in m and (h := _text(m[k], f"model.{k}", none=k != "sha256")) is not None and (
                len(h) != 64 or set(h) - set(_HEX64)):
            raise _bad(f"model.{k}", h, "must be a sha256 (64 hex digits)")
    for k in ("weights", "activations", "kv_dtype", "name"):
        if k in m:
            _text(m[k], f"model.{k}", none=k != "weights")
    if "load" in m:
        load = _object(m["load"], "model.load", ())
        for k, v in load.items():
            if k not in ("dtype", "quantize", "activations", "kv_dtype"):
                raise _bad(f"model.load.{k}", v, "not a load setting (dtype, quantize, activations, kv_dtype)")
            _text(v, f"model.load.{k}", none=True)
    r = _object(rec["request"], "request", ("prompt_ids", "temperature", "top_k", "top_p", "min_p",
                                             "repetition_penalty", "max_new_tokens", "eos", "stop"))
    _ids(r["prompt_ids"], "request.prompt_ids", empty=False)
    _number(r["temperature"], "request.temperature", lambda v: v >= 0, "must be a number >= 0")
    _int(r["top_k"], "request.top_k")
    _number(r["top_p"], "request.top_p", lambda v: 0 < v <= 1, "must be a number in (0, 1]")
    _number(r["min_p"], "request.min_p", lambda v: 0 <= v <= 1, "must be a number in [0, 1]")
    _number(r["repetition_penalty"], "request.repetition_penalty", lambda v: v > 0, "must be a number > 0")
    _int(r["max_new_tokens"], "request.max_new_tokens")
    _ids(r["eos"], "request.eos")
    if not isinstance(r["stop"], list) or not all(isinstance(x, str) and x for x in r["stop"]):
        raise _bad("request.stop", r["stop"], "must be a list of non-empty strings")
    if r.get("constraint") is not None:
        c = _object(r["constraint"], "request.constraint", ("kind", "source"))
        if c["kind"] not in KINDS:
            raise _bad("request.constraint.kind", c["kind"], f"must be one of {', '.join(KINDS)}")
        _text(c["source"], "request.constraint.source")
    choices = rec["choices"]
    if not isinstance(choices, list) or not choices:
        raise _bad("choices", choices, "must be a non-empty list (a receipt signs at least one answer)")
    for i, c in enumerate(choices):
        c = _object(c, f"choices[{i}]", ("seed", "token_ids", "sha256", "finish_reason"))
        if c["seed"] is not None:
            _int(c["seed"], f"choices[{i}].seed", 0, 2 ** 63)
        _ids(c["token_ids"], f"choices[{i}].token_ids")
        _text(c["sha256"], f"choices[{i}].sha256")
        if c["finish_reason"] not in FINISH_REASONS:
            raise _bad(f"choices[{i}].finish_reason", c["finish_reason"], f"must be one of {', '.join(FINISH_REASONS)}")


def replay(model: Any, receipt: dict) -> list[tuple[list[int], str, Exception | None]]:
    """Each choice's (token ids, finish reason, the error that ended it or None) by plain decoding of
    the receipt's request on `model`. The receipt is checked first (`check`)."""
    check(receipt)
    return _replay(model, receipt)


def _replay(model: Any, receipt: dict) -> list[tuple[list[int], str, Exception | None]]:
    """replay() of a receipt already checked."""
    r = receipt["request"]
    params = {k: r[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
    grammar = None
    if r.get("constraint") is not None:
        kind, value = r["constraint"]["kind"], r["constraint"]["source"]
        if kind == "choice":
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidRequest("receipt: request.constraint.source is not a JSON list of choices",
                                     "receipt") from None
        grammar = model.constraint(kind, value, "receipt.request.constraint")
    out = []
    for c in receipt["choices"]:
        req = make_request(model.net.limits, r["prompt_ids"], r["max_new_tokens"],
                           SamplingParams(**params, seed=c["seed"]), eos=r["eos"], stop=r["stop"], constraint=grammar)
        (seq,), _ = run_batch(model.net, [req], None, None)
        ids, finish = list(seq.generated), seq.finish_reason
        if req.stop and model.tokenizer is not None:
            n, hit = tokens_through_stop(model.tokenizer, ids, list(req.stop))
            ids, finish = ids[:n], "stop" if hit else finish
        out.append((ids, finish, seq.error if finish == "error" else None))
    return out


def verify(model: Any, receipt: dict) -> Verdict:
    """Check the receipt's form, then replay it on `model` and compare: the model's identity, the
    numerics version, each choice's sha256 against its ids, and the replayed tokens and finish reasons.
    A receipt that cannot be replayed on this model (another vocabulary) raises InvalidRequest saying
    the model differences first."""
    check(receipt)
    problems = []
    want, have = receipt["model"], model_facts(model)
    for key in ("sha256", "tokenizer_sha256", "weights", "activations", "kv_dtype"):
        if want.get(key) != have[key]:
            problems.append(f"model {key}: the receipt's {want.get(key)!r}, this model's {have[key]!r}")
    if receipt["numerics"] != NUMERICS_VERSION and receipt["numerics"] not in COMPATIBLE:
        problems.append(f"numerics version: the receipt's {receipt['numerics']!r}, this exactspec's "
                        f"{NUMERICS_VERSION} (a replay may differ where the kernels' arithmetic changed)")
    try:
        replayed = _replay(model, receipt)
    except InvalidRequest as e:
        if not problems:
            raise
        raise InvalidRequest(f"receipt: {'; '.join(problems)}; so the replay cannot run on this model: {e}",
                             "receipt") from None
    firsts: list[int | None] = []
    for i, (c, (ids, finish, error)) in enumerate(zip(receipt["choices"], replayed)):
        got = c["token_ids"]
        if c["sha256"] != ids_sha256(got):
            problems.append(f"choice {i}: its sha256 does not match its token_ids (the receipt was altered)")
        first = next((j for j, (a, b) in enumerate(zip(got, ids)) if a != b), None)
        if first is None and len(got) != len(ids):
            first = min(len(got), len(ids))
        firsts.append(first)
        if error is not None:
            problems.append(f"choice {i}: the replay failed after {len(ids)} tokens ({type(error).__name__}: {error})")
        elif first is not None:
            problems.append(f"choice {i}: the replay differs at output position {first} (receipt "
                            f"{got[first] if first < len(got) else 'ends'}, replay "
                            f"{ids[first] if first < len(ids) else 'ends'})")
        elif c["finish_reason"] != finish:
            problems.append(f"choice {i}: finish reason {c['finish_reason']!r}, the replay's {finish!r}")
    return Verdict(not problems, problems, firsts)
