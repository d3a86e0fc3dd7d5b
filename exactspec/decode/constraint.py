"""Constrained decoding: a grammar (a JSON schema, a Lark or GBNF grammar, a regex, a choice of strings)
that keeps every token of the answer inside it. llguidance (Microsoft's Rust matcher, the one vLLM and
llama.cpp use too) computes which tokens may come next; the pick takes the best of those only.

Why the promise holds: the mask at a position is a function of the sequence's own tokens (the
matcher is advanced on committed tokens only, and rolled back from the drafts it tried), so a masked
pick is a function of the prefix exactly as the logits are. Plain constrained decoding is this with
no drafts; with drafts every row is picked under the mask of its own prefix.

Forced text (the schema's keys, quotes, braces; the one value an enum leaves) is proposed as a draft of
certainty 1: llguidance's tokens for the forced bytes, verified like any draft. Where the model would
split the text into other tokens the verify keeps the model's split, so the answer is plain constrained
decoding's, never a re-tokenization of the string.

Why llguidance (measured on SmolLM2's 49k vocabulary): a schema compiles in ~1 ms, and masks plus
forced tokens take ~2% of a constrained run's wall time (bench/structured.py); the wheel has no
dependencies; it takes JSON Schema's common keywords, Lark (with %json inside), regexes, and llama.cpp's
GBNF through its converter. xgrammar, the other candidate, was not measured here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import ConstraintError, GenerationError, InvalidRequest

# How JSON is written under a schema: one space after ',' and ':', no other whitespace (forced text the
# model need not guess; json.dumps's default separators)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "grammar", "regex", "choice")
MAX_SOURCE = 256 * 1024  # characters of a constraint's text: a larger one is refused before it is compiled


class Vocab:
    """A model's tokenizer as llguidance reads it (built once per model, ~0.2 s for 49k tokens)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: Sequence[int]):
        import llguidance
        self.n_vocab, self.eos = n_vocab, frozenset(int(t) for t in eos)
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=sorted(self.eos) or None)


@dataclass(frozen=True)
class Grammar:
    """A validated constraint: `kind` one of KINDS, `source` as the caller wrote it (the schema as JSON
    text, the grammar, the regex, the choices as a JSON list) and llguidance's compiled form."""
    kind: str
    source: str
    compiled: str = field(repr=False)
    vocab: Vocab = field(repr=False, compare=False)
    name: str = field(default="", compare=False)  # the field the caller gave it in (errors name it)


def _schema(v: Any) -> dict:
    if isinstance(v, type) and hasattr(v, "model_json_schema"):  # a pydantic model class
        v = v.model_json_schema()
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise InvalidRequest(f"json_schema: not valid JSON ({e})", "json_schema") from None
    if not isinstance(v, dict):
        raise InvalidRequest(f"json_schema: expected a JSON schema object (a dict or a pydantic model class), got "
                             f"{type(v).__name__}", "json_schema")
    return v


def _gbnf(text: str) -> str:
    from llguidance.gbnf_to_lark import gbnf_to_lark
    try:
        return gbnf_to_lark(text)
    except Exception as e:  # the converter raises its own parse errors
        raise InvalidRequest(f"grammar: not a valid GBNF grammar ({_line(str(e))})", "grammar") from None


def make_grammar(vocab: Vocab, kind: str, value: Any, name: str | None = None) -> Grammar:
    """A Grammar for a constraint given as the library takes it, or InvalidRequest naming `name`
    (default: the kind): json_schema a dict, JSON text or pydantic model class; grammar Lark text (or
    GBNF, told by its '::='); regex a string; choice a list of strings."""
    name = name or kind
    _size(value, name)
    try:
        return _make(vocab, kind, value, name)
    except InvalidRequest:
        raise
    except Exception as e:  # llguidance's own errors on what it was given (a ValueError, a RuntimeError)
        raise InvalidRequest(f"{name}: not a valid constraint ({type(e).__name__}: {_line(str(e))})", name) from None


def _line(message: str) -> str:
    """llguidance's message (several lines, a caret under the spot) as one line."""
    return " ".join(message.split())[:400]


def _make(vocab: Vocab, kind: str, value: Any, name: str) -> Grammar:
    from llguidance import LLMatcher
    if kind == "json_schema":
        # the schema's text in the caller's key order (the order properties are written in), compiled from
        # that very text: a receipt keeps it, and its replay compiles the same grammar
        source = json.dumps(_schema(value))
        compiled = LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
    elif kind in ("grammar", "regex") and not isinstance(value, str):
        raise InvalidRequest(f"{name}: expected a string, got {type(value).__name__}", name)
    elif kind == "grammar":
        source = value
        compiled = LLMatcher.grammar_from_lark(_gbnf(value) if "::=" in value else value)
    elif kind == "regex":
        source, compiled = value, LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest(f"{name}: expected a non-empty list of non-empty strings", name)
        source = json.dumps(list(value))
        # one lexer terminal: any number of choices (as parser alternatives, a row of over 2000 fails)
        compiled = LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in value))
    else:
        raise InvalidRequest(f"constraint kind {kind!r}: one of {', '.join(KINDS)}", name)
    bad, messages = LLMatcher.validate_grammar_with_warnings(compiled, vocab.tok)
    if bad:
        raise InvalidRequest(f"{name}: {_line(messages[0]) if messages else 'not a valid constraint'}", name)
    g = Grammar(kind, source, compiled, vocab, name)
    _probe(g)
    return g


def _size(value: Any, name: str) -> None:
    """Refuse a constraint whose text is over MAX_SOURCE characters, before any compile (a pydantic class
    is its own size check's business: not text)."""
    if isinstance(value, (str, list, tuple, dict)):
        n = len(value) if isinstance(value, str) else len(json.dumps(value, default=str))
        if n > MAX_SOURCE:
            raise InvalidRequest(f"{name}: {n} characters; at most {MAX_SOURCE} are taken", name)


def _probe(g: Grammar) -> None:
    """Run the matcher over a first step (the mask at the start; the first allowed token consumed, its
    forced text computed) so that what fails at once fails here, named: a grammar that allows no text
    at all (a rule that only refers to itself, schemas whose refs point at each other), or one past
    the matcher's limits at its first step (a row of thousands of alternatives, a forced run of a
    million characters)."""
    m = Matcher(g)
    try:
        allowed = m.mask()
        first = [int(t) for t in np.flatnonzero(allowed) if int(t) not in g.vocab.eos][:1]
        if first:
            m.advance(first)
            m.m.compute_ff_tokens()
            m._check("its forced text")
    except GenerationError as e:
        why = _line((m.m.get_error() or "").strip().splitlines()[0]) if m.m.is_error() else str(e)
        if "NoExtensionBias" in why or "allows no token" in why:
            why = "it allows no text (a rule that can only refer to itself, or refs that point at each other)"
        raise InvalidRequest(f"{g.name}: the matcher cannot follow this constraint: {why}", g.name) from None


def lark_json(schema: dict) -> str:
    """A schema as a Lark rule's body (%json, written as JSON_OPTIONS say): for grammars that wrap JSON."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


class Matcher:
    """One sequence's place in its grammar. `mask()` is a function of the tokens `advance`d so far."""

    def __init__(self, g: Grammar):
        from llguidance import LLMatcher
        self.g, self.n = g, g.vocab.n_vocab
        self.m = LLMatcher(g.vocab.tok, g.compiled, log_level=0)
        self._check("the grammar")

    def _check(self, what: str) -> None:
        if self.m.is_error():  # llguidance's message: a first line, then its parser state (dozens of lines)
            first = (self.m.get_error() or "").strip().splitlines() or ["(no message)"]
            raise ConstraintError(f"{self.g.name or self.g.kind}: the matcher cannot follow the constraint "
                                  f"({what}): {first[0][:300]}", self.g.name or self.g.kind)

    @property
    def done(self) -> bool:
        """Nothing can follow the tokens so far: the answer is complete."""
        return self.m.is_stopped()

    def mask(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar allows next. None allowed is an error, never an unconstrained pick."""
        bits = np.frombuffer(self.m.compute_bitmask(), np.uint8)
        self._check("computing the allowed tokens")
        allowed = np.unpackbits(bits, bitorder="little")[: self.n].astype(bool)
        if not allowed.any():
            raise ConstraintError(f"{self.g.name or self.g.kind}: the constraint allows no token after this output",
                                  self.g.name or self.g.kind)
        return allowed

    def advance(self, tokens: Sequence[int]) -> None:
        if tokens and not self.m.consume_tokens(list(tokens)):
            self._check(f"token {list(tokens)}")
            raise GenerationError(f"constraint ({self.g.kind}): tokens {list(tokens)} are not allowed here")

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    def draft(self, proposed: Sequence[int], limit: int) -> tuple[list[int], int]:
        """The draft to verify, at most `limit` tokens: where the grammar forces text, its tokens (the
        drafter's where they spell the same); elsewhere the drafter's tokens while the grammar allows
        them. Returns (draft, how many of its tokens are the drafter's own guesses). The matcher is left
        where it was."""
        out, guessed, i = [], 0, 0
        eos = self.g.vocab.eos
        while len(out) < limit and not self.m.is_stopped():
            ff = [t for t in self.m.compute_ff_tokens() if t not in eos][: limit - len(out)]
            if ff:
                if list(proposed[i: i + len(ff)]) == ff:
                    i += len(ff)
                else:
                    i = len(proposed)  # the drafter guessed past other text: its tokens no longer line up
                took = self.m.try_consume_tokens(ff)
                out += ff[:took]
                if took < len(ff):
                    break
            elif i < len(proposed) and proposed[i] not in eos and self.m.try_consume_tokens([proposed[i]]) == 1:
                out.append(int(proposed[i]))
                guessed, i = guessed + 1, i + 1
            else:
                break
        self.rollback(len(out))
        return out, guessed


def masked(row: torch.Tensor, allowed: np.ndarray) -> torch.Tensor:
    """A logits row with the tokens the grammar forbids at -inf."""
    return torch.where(torch.from_numpy(allowed), row, torch.tensor(float("-inf")))
