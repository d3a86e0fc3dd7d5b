"""One request, validated once. `make_request` is the only place a generation's inputs are
checked (prompt ids against the vocabulary, prompt + max_new_tokens against the context, the
sampling parameters, the draft length); everything after it (the decode loop, the engine, the
server) takes a `Request` and trusts it. `check_prompt` is the same prompt check, for calls that
only run a forward (`Model.logits`).

Knows only token ids: text is encoded by the caller (api.Model, the server) before it gets here.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..errors import ContextLengthError, InvalidRequest
from ..model.config import Limits
from .constraint import Grammar
from .sampling import SamplingParams


MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows


class DraftLength:
    """How many tokens to ask the drafter for, as a request asks (checked here; the rules that
    follow from it are decode/policy.py's): fixed k, "dynamic" or "auto". The output never depends
    on it; only speed does."""

    def __init__(self, k: int | str = 0, max_k: int = 16):
        self.auto = k == "auto"  # by cost (decode/cost.py): the k with the most expected tokens per second
        if k in ("dynamic", "auto"):
            self.dynamic, self.k0, self.max_k = k == "dynamic", 4, max_k
        elif isinstance(k, int) and not isinstance(k, bool) and k >= 0:
            self.dynamic, self.k0, self.max_k = False, k, k
        else:
            raise InvalidRequest(f"num_draft_tokens={k!r}: must be an integer >= 0, 'dynamic' or 'auto'",
                                 "num_draft_tokens")

    def __repr__(self) -> str:
        return "DraftLength('dynamic')" if self.dynamic else "DraftLength('auto')" if self.auto else \
            f"DraftLength({self.k0})"


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]  # token ids, each in [0, vocab), 1 <= len < max_context
    params: SamplingParams  # its seed is resolved: a run with the same Request replays exactly
    max_new_tokens: int  # >= 0; len(prompt) + max_new_tokens <= max_context
    eos: frozenset[int] = frozenset()  # stop after any of these ids ("stop"); empty = ignore EOS
    stop: tuple[str, ...] = ()  # stop strings: matched on text by the caller that has a tokenizer
    draft_len: DraftLength = field(default_factory=DraftLength)  # speculation: k per verify step
    logprobs: int | None = None  # per generated token: its logprob and this many alternatives; None = off
    logprobs_mode: str = "raw"  # "raw": of the model's logits; "processed": after the sampling filters
    cache_scope: str = ""  # the prefix cache shares blocks among requests of one scope only (a tenant)
    prediction: tuple[int, ...] = ()  # the caller's guess at the output (OpenAI's Predicted Outputs): drafts
    constraint: Grammar | None = None  # every token kept inside it (decode/constraint.py); forced text: drafts


def _int(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InvalidRequest(f"{name}={v!r}: must be an integer >= {lo}", name)
    return v


def check_prompt(ids: Iterable, limits: Limits, name: str = "prompt", room: int = 0) -> tuple[int, ...]:
    """Token ids as a tuple of ints, each inside the vocabulary, with `room` positions left in the
    context after them. The only context-length check of the package."""
    field = name.split(" ")[0]  # "prompt 3" (of a batch) is the field "prompt"
    if isinstance(ids, (str, bytes)):
        raise InvalidRequest(f"{name}: expected token ids, got text (encode it with the model's tokenizer)", field)
    if hasattr(ids, "tolist"):  # a numpy array or torch tensor of ids
        ids = ids.tolist()
    try:
        out = tuple(ids)
    except TypeError:
        raise InvalidRequest(f"{name}: expected a list of int token ids, got {type(ids).__name__}", field) from None
    if not out:
        raise InvalidRequest(f"{name} is empty: at least one token is needed", field)
    bad = next((t for t in out if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise InvalidRequest(f"{name}: token ids must be integers, got {bad!r}", field)
    bad = next((t for t in out if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{name}: token id {bad} outside the vocabulary [0, {limits.vocab_size})", field)
    if len(out) + room > limits.max_context:
        what = f"{len(out)} in the {name}" + (f" + {room} new" if room else "")
        too_long = len(out) + min(room, 1) > limits.max_context  # no room even for one new token
        raise ContextLengthError(f"This model's maximum context length is {limits.max_context} tokens; the request "
                                 f"needs {len(out) + room} ({what})", field if too_long else "max_new_tokens")
    return tuple(int(t) for t in out)


def make_request(limits: Limits, prompt: Iterable, max_new_tokens: int | None = 128,
                 params: SamplingParams | None = None, *, eos: Iterable[int] = (),
                 stop: str | Iterable[str] | None = None, num_draft_tokens: int | str = 0,
                 logprobs: int | None = None, logprobs_mode: str = "raw", name: str = "prompt", cache_scope: str = "",
                 prediction: Sequence[int] = (), constraint: Grammar | None = None, **sampling) -> Request:
    """A validated Request, or InvalidRequest naming the field. max_new_tokens=None: as many as the
    context holds. The sampling parameters: `params` (one SamplingParams), or its fields as keywords
    (temperature, top_k, top_p, min_p, repetition_penalty, seed). seed=None: greedy ignores it;
    sampling draws a fresh one (kept in the Request's params, reported in the result's stats) so the
    run can be replayed. `prediction`: token ids the output is expected to repeat (a file being edited),
    proposed as drafts, so only speed depends on it; with num_draft_tokens 0 the draft length is then
    "auto" (by cost). `constraint`: a Grammar (constraint.make_grammar) every token must keep the output
    inside; with num_draft_tokens other than 0 the text it forces is proposed as drafts."""
    if max_new_tokens is not None:
        _int("max_new_tokens", max_new_tokens)
    ids = check_prompt(prompt, limits, name, 1 if max_new_tokens is None else max_new_tokens)
    if max_new_tokens is None:
        max_new_tokens = limits.max_context - len(ids)
    if params is not None and sampling:
        raise InvalidRequest(f"give the sampling parameters as params or as keywords, not both ({', '.join(sampling)})",
                             next(iter(sampling)))
    params = (params if params is not None else _params(sampling)).resolved()
    try:
        eos_ids = frozenset(_int("eos", t) for t in eos)
    except TypeError:
        raise InvalidRequest(f"eos={eos!r}: must be a list of token ids", "eos") from None
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stops):
        raise InvalidRequest(f"stop={stop!r}: must be a string or a list of strings", "stop")
    if limits.max_stops is not None and len(stops) > limits.max_stops:
        raise InvalidRequest(f"stop: {len(stops)} stop strings; at most {limits.max_stops} are allowed", "stop")
    if limits.max_stop_chars is not None and any(len(s) > limits.max_stop_chars for s in stops):
        raise InvalidRequest(f"stop: a stop string is longer than {limits.max_stop_chars} characters", "stop")
    if logprobs is not None and (_int("logprobs", logprobs) > MAX_TOP_LOGPROBS):
        raise InvalidRequest(f"logprobs={logprobs}: at most {MAX_TOP_LOGPROBS} alternatives", "logprobs")
    if logprobs_mode not in ("raw", "processed"):
        raise InvalidRequest(f"logprobs_mode={logprobs_mode!r}: 'raw' or 'processed'", "logprobs_mode")
    if not isinstance(cache_scope, str):
        raise InvalidRequest(f"cache_scope={cache_scope!r}: must be a string", "cache_scope")
    # a hint, as OpenAI's API takes it: what cannot fit the context is cut, never refused
    prediction = list(prediction.tolist() if hasattr(prediction, "tolist") else prediction)[:limits.max_context - 1]
    predicted = check_prompt(prediction, limits, "prediction") if prediction else ()
    if constraint is not None and not isinstance(constraint, Grammar):
        raise InvalidRequest(f"constraint={constraint!r}: expected a Grammar (decode.constraint.make_grammar)",
                             "constraint")
    k = num_draft_tokens if num_draft_tokens or not predicted else "auto"
    return Request(ids, params, max_new_tokens, eos_ids, tuple(s for s in stops if s), DraftLength(k),
                   logprobs, logprobs_mode, cache_scope, predicted, constraint)


def _params(sampling: dict) -> SamplingParams:
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    for k in sampling:
        if k not in known:
            raise InvalidRequest(f"{k}: not a request argument (sampling: {', '.join(sorted(known))})", k)
    return SamplingParams(**sampling)
