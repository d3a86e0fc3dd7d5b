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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

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


def _field(d: Any, key: str, kind: type | tuple, where: str):
    v = d.get(key) if isinstance(d, dict) else None
    if not isinstance(v, kind) or isinstance(v, bool) and kind in (int, (int, float)):
        raise InvalidRequest(f"receipt: {where}{key} is {v!r}, not a valid value", "receipt")
    return v


def replay(model: Any, receipt: dict) -> list[tuple[list[int], str]]:
    """Each choice's (token ids, finish reason) by plain decoding of the receipt's request on `model`."""
    r = _field(receipt, "request", dict, "")
    params = dict(temperature=_field(r, "temperature", (int, float), "request."),
                  top_k=_field(r, "top_k", int, "request."), top_p=_field(r, "top_p", (int, float), "request."),
                  min_p=_field(r, "min_p", (int, float), "request."),
                  repetition_penalty=_field(r, "repetition_penalty", (int, float), "request."))
    stops, prompt = _field(r, "stop", list, "request."), _field(r, "prompt_ids", list, "request.")
    n, eos = _field(r, "max_new_tokens", int, "request."), _field(r, "eos", list, "request.")
    grammar = None
    if r.get("constraint") is not None:
        kind = _field(r["constraint"], "kind", str, "request.constraint.")
        source = _field(r["constraint"], "source", str, "request.constraint.")
        value = source
        if kind == "choice":
            try:
                value = json.loads(source)
            except ValueError:
                raise InvalidRequest("receipt: request.constraint.source is not a JSON list of choices",
                                     "receipt") from None
        grammar = model.constraint(kind, value, "receipt.request.constraint")
    out = []
    for c in _field(receipt, "choices", list, ""):
        seed = c.get("seed") if isinstance(c, dict) else None
        req = make_request(model.net.limits, prompt, n, SamplingParams(**params, seed=seed), eos=eos, stop=stops,
                           constraint=grammar)
        (seq,), _ = run_batch(model.net, [req], None, None)
        ids, finish = list(seq.generated), seq.finish_reason
        if req.stop and model.tokenizer is not None:
            n, hit = tokens_through_stop(model.tokenizer, ids, list(req.stop))
            ids, finish = ids[:n], "stop" if hit else finish
        out.append((ids, finish))
    return out


def verify(model: Any, receipt: dict) -> Verdict:
    """Replay `receipt` on `model` and compare: the model's identity, the numerics version, each
    choice's sha256 against its ids, and the replayed tokens and finish reasons."""
    if not isinstance(receipt, dict) or receipt.get("receipt") != FORMAT:
        raise InvalidRequest(f"receipt: not an exactspec receipt (expected \"receipt\": {FORMAT!r})", "receipt")
    problems = []
    want = _field(receipt, "model", dict, "")
    have = model_facts(model)
    for key in ("sha256", "tokenizer_sha256", "weights", "activations", "kv_dtype"):
        if want.get(key) != have[key]:
            problems.append(f"model {key}: the receipt's {want.get(key)!r}, this model's {have[key]!r}")
    if receipt.get("numerics") != NUMERICS_VERSION and receipt.get("numerics") not in COMPATIBLE:
        problems.append(f"numerics version: the receipt's {receipt.get('numerics')!r}, this exactspec's "
                        f"{NUMERICS_VERSION} (a replay may differ where the kernels' arithmetic changed)")
    firsts: list[int | None] = []
    for i, (c, (ids, finish)) in enumerate(zip(receipt["choices"], replay(model, receipt))):
        got = _field(c, "token_ids", list, f"choices[{i}].")
        if c.get("sha256") != ids_sha256(got):
            problems.append(f"choice {i}: its sha256 does not match its token_ids (the receipt was altered)")
        first = next((j for j, (a, b) in enumerate(zip(got, ids)) if a != b), None)
        if first is None and len(got) != len(ids):
            first = min(len(got), len(ids))
        firsts.append(first)
        if first is not None:
            problems.append(f"choice {i}: the replay differs at output position {first} (receipt "
                            f"{got[first] if first < len(got) else 'ends'}, replay "
                            f"{ids[first] if first < len(ids) else 'ends'})")
        elif c.get("finish_reason") != finish:
            problems.append(f"choice {i}: finish reason {c.get('finish_reason')!r}, the replay's {finish!r}")
    return Verdict(not problems, problems, firsts)
