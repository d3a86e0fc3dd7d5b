"""The decoding loop: prefill, propose, verify, accept, roll back. Plain decoding is this loop
with no drafter (k = 0). Batches of sequences of any lengths go through one target forward per
step, each sequence accepting its own number of tokens.

Invariant kept by the loop: a sequence's cache holds keys for all of its tokens but the last;
each step feeds [last token] + drafts at positions len-1, len, ..., and afterwards the valid
length is len(tokens) - 1 again (the rollback: rejected drafts' keys are left as garbage, and the
next step overwrites them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


from .drafters import Drafter
from .errors import ContextLengthError, InvalidArgumentError
from .model import Transformer, int64s
from .sampling import SamplingParams, pick, pick_rows


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    forward_passes: int = 0  # target forwards (prefill counts one)
    draft_forward_passes: int = 0
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    steps: int = 0  # verify steps (target forwards after prefill)
    prefill_time: float = 0.0
    wall_time: float = 0.0
    seed: int | None = None  # the sampling seed used (temperature > 0), so a run with seed=None can be replayed
    proposed_at: list[int] = field(default_factory=list)  # [i]: steps that proposed a draft token at offset i
    accepted_at: list[int] = field(default_factory=list)  # [i]: ... and had it accepted

    def count_position(self, i: int, proposed: int, accepted: int) -> None:
        while len(self.proposed_at) <= i:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        self.proposed_at[i] += proposed
        self.accepted_at[i] += accepted

    def count_step(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        for i in range(proposed):
            self.count_position(i, 1, int(i < accepted))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify step (accepted drafts + the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                 tokens_per_second=self.tokens_per_second)
        return d


class DraftLength:
    """How many tokens to ask the drafter for. Fixed k, or dynamic ("grow by 2 after a fully
    accepted draft, shrink by 1 after a rejection", as transformers' assisted generation does).
    The output never depends on it; only speed does."""

    def __init__(self, k: int | str, max_k: int = 16):
        if k == "dynamic":
            self.dynamic, self.k0, self.max_k = True, 4, max_k
        elif isinstance(k, int) and not isinstance(k, bool) and k >= 0:
            self.dynamic, self.k0, self.max_k = False, k, k
        else:
            raise InvalidArgumentError(f"num_draft_tokens={k!r}: must be an integer >= 0 or 'dynamic'")

    def update(self, k: int, proposed: int, accepted: int) -> int:
        if not self.dynamic or proposed == 0:
            return k
        return min(self.max_k, k + 2) if accepted == proposed else max(1, k - 1)


@dataclass
class Sequence:
    slot: int
    tokens: list[int]  # prompt + generated
    prompt_len: int
    params: SamplingParams
    max_new: int
    eos: frozenset[int] = frozenset()
    k: int = 0
    finish_reason: str | None = None  # "stop" (EOS) | "length" | "cancelled"
    prefilled: bool = False
    stats: Stats = field(default_factory=Stats)
    tag: object = None  # the caller's handle (request, prompt index)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def _commit(seq: Sequence, new: list[int], capacity: int) -> list[int]:
    """Append tokens until a stop; returns the ones appended."""
    kept = []
    for t in new:
        seq.tokens.append(t)
        kept.append(t)
        if t in seq.eos:
            seq.finish_reason = "stop"
        elif len(seq.tokens) - seq.prompt_len >= seq.max_new:
            seq.finish_reason = "length"
        elif len(seq.tokens) >= capacity:
            seq.finish_reason = "length"  # the context is full
        if seq.finish_reason:
            break
    return kept


class Batch:
    """Sequences decoded together, one target forward per `step`. Sequences join (`add`) and
    leave (finish, `cancel`) between steps: continuous batching. A step feeds the whole prompt
    of each newly added sequence and [last token] + drafts of each running one, in one forward;
    thanks to batch invariance no sequence's tokens depend on what else is in the batch."""

    def __init__(self, target: Transformer, n_slots: int, capacity: int, drafter: Drafter | None = None,
                 draft_len: DraftLength | None = None):
        self.target, self.drafter = target, drafter
        self.draft_len = draft_len or DraftLength(0)
        self.capacity = min(capacity, target.max_context)
        self.cache = target.new_cache(n_slots, self.capacity)
        self.free = list(range(n_slots - 1, -1, -1))
        self.seqs: list[Sequence] = []
        if drafter is not None:
            drafter.begin(n_slots, self.capacity)

    def check_prompt(self, prompt: list[int], name: str = "prompt") -> None:
        if not prompt:
            raise InvalidArgumentError(f"{name} is empty: at least one token is needed")
        if len(prompt) >= self.capacity:
            raise ContextLengthError(f"{name} has {len(prompt)} tokens; the model's context (max_context) "
                                     f"is {self.capacity}")
        V = self.target.cfg.vocab_size
        bad = [t for t in prompt if not (0 <= t < V)]
        if bad:
            raise InvalidArgumentError(f"{name}: token id {bad[0]} outside the vocabulary [0, {V})")

    def add(self, prompt: list[int], params: SamplingParams, max_new: int, eos: set[int] | frozenset = frozenset(),
            tag: object = None) -> Sequence:
        if not isinstance(max_new, int) or max_new < 0:
            raise InvalidArgumentError(f"max_new_tokens={max_new!r}: must be an integer >= 0")
        self.check_prompt(prompt)
        if not self.free:
            raise RuntimeError("Batch.add: no free slot")
        s = Sequence(self.free.pop(), list(prompt), len(prompt), params, max_new, frozenset(eos), self.draft_len.k0,
                     tag=tag)
        if max_new == 0:
            s.finish_reason = "length"
        self.seqs.append(s)
        return s

    def cancel(self, s: Sequence) -> None:
        if s.finish_reason is None:
            s.finish_reason = "cancelled"
        self._release()

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.seqs if s.finish_reason is None]

    def _release(self) -> None:
        for s in [s for s in self.seqs if s.finish_reason is not None]:
            self.seqs.remove(s)
            self.free.append(s.slot)
            if self.drafter is not None:
                self.drafter.release(s.slot)

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """One target forward. Returns (sequence, tokens it committed) for each; sequences that
        finished (see `finish_reason`) have left the batch when it returns."""
        live = self.running
        if not live:
            return []
        t0 = time.perf_counter()
        new = [s for s in live if not s.prefilled]
        old = [s for s in live if s.prefilled]
        # Never draft past the token budget or the cache: the verify yields up to k + 1 tokens.
        ks = [max(0, min(s.k, s.max_new - len(s.generated) - 1, self.capacity - len(s.tokens) - 1)) for s in old]
        drafts: list[list[int]] = [[] for _ in old]
        if self.drafter is not None and any(ks):
            drafts = self.drafter.propose([s.slot for s in old], [s.tokens for s in old], ks, [s.params for s in old])
        tok, slot, pos, rows = [], [], [], []
        for s in new:  # the whole prompt; only its last row's logits are needed
            n = len(s.tokens)
            tok += s.tokens
            slot += [s.slot] * n
            pos += range(n)
            rows.append(len(tok) - 1)
        for s, d in zip(old, drafts):  # [last token] + drafts at positions len-1, len, ...
            n = len(s.tokens)
            rows += range(len(tok), len(tok) + len(d) + 1)
            tok += [s.tokens[-1]] + d
            slot += [s.slot] * (len(d) + 1)
            pos += range(n - 1, n + len(d))
        logits = self.target.forward(int64s(tok), int64s(slot), int64s(pos), self.cache, int64s(rows))
        out = []
        for i, s in enumerate(new):
            s.prefilled = True
            s.stats.prefill_time = time.perf_counter() - t0
            t = pick(logits[i], s.params, len(s.tokens), s.tokens)
            out.append((s, _commit(s, [t], self.capacity)))
        r = len(new)
        for s, d in zip(old, drafts):
            n = len(s.tokens)
            choice = pick_rows(logits[r: r + len(d) + 1], s.params, range(n, n + len(d) + 1), s.tokens, d)
            r += len(d) + 1
            a = 0
            while a < len(d) and d[a] == choice[a]:
                a += 1
            if self.drafter is not None:
                self.drafter.accepted(s.slot, a)
            s.stats.count_step(len(d), a)
            s.k = self.draft_len.update(s.k, len(d), a)
            out.append((s, _commit(s, d[:a] + [choice[a]], self.capacity)))
        for s in live:
            s.stats.forward_passes += 1
        self._release()  # finished sequences leave now; their slots take the next arrivals
        return out


OnToken = Callable[[int, list[int]], None]  # (prompt index, new token ids)


def decode(target: Transformer, prompts: list[list[int]], params: list[SamplingParams], max_new_tokens: int,
           eos: set[int], drafter: Drafter | None = None, draft_len: DraftLength | None = None,
           on_token: OnToken | None = None) -> list[Sequence]:
    """Decode a fixed batch to the end: all prompts join at once, the loop steps until none runs."""
    draft_len = draft_len or DraftLength(0)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InvalidArgumentError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 0")
    t0 = time.perf_counter()
    capacity = min(target.max_context, max((len(p) for p in prompts), default=1) + max_new_tokens
                   + draft_len.max_k + 1)
    batch = Batch(target, len(prompts), capacity, drafter, draft_len)
    for i, p in enumerate(prompts):
        batch.check_prompt(p, f"prompt {i}")
    seqs = [batch.add(p, params[i], max_new_tokens, eos, tag=i) for i, p in enumerate(prompts)]
    while batch.running:
        for s, new in batch.step():
            if on_token is not None and new:
                on_token(s.tag, new)
    wall = time.perf_counter() - t0
    for s in seqs:  # forward_passes, proposed/accepted and prefill_time were counted per step
        s.stats.new_tokens = len(s.generated)
        s.stats.prompt_tokens = s.prompt_len
        s.stats.wall_time = wall
        s.stats.draft_forward_passes = drafter.forward_passes if drafter is not None else 0
    return seqs
