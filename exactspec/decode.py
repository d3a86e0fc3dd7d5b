"""The decoding loop: prefill, propose, verify, accept, roll back. Plain decoding is this loop
with no drafter (k = 0). Batches of sequences of any lengths go through one target forward per
step, each sequence accepting its own number of tokens.

Invariant kept by the loop: a sequence's cache holds keys for all of its tokens but the last;
each step feeds [last token] + drafts at positions len-1, len, ..., and the cache length then
moves to len(tokens) - 1 again (the rollback: rejected drafts' keys are left as garbage).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .drafters import Drafter
from .errors import ContextLengthError, InvalidArgumentError
from .model import Transformer
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
    k: int = 0
    finish_reason: str | None = None
    stats: Stats = field(default_factory=Stats)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


OnToken = Callable[[int, list[int]], None]  # (sequence index, new token ids)


def _commit(seq: Sequence, new: list[int], eos: set[int], capacity: int) -> list[int]:
    """Append tokens until a stop; returns the ones appended."""
    kept = []
    for t in new:
        seq.tokens.append(t)
        kept.append(t)
        if t in eos:
            seq.finish_reason = "stop"
        elif len(seq.tokens) - seq.prompt_len >= seq.max_new:
            seq.finish_reason = "length"
        elif len(seq.tokens) >= capacity:
            seq.finish_reason = "length"  # the context is full
        if seq.finish_reason:
            break
    return kept


def decode(target: Transformer, prompts: list[list[int]], params: list[SamplingParams], max_new_tokens: int,
           eos: set[int], drafter: Drafter | None = None, draft_len: DraftLength | None = None,
           on_token: OnToken | None = None) -> tuple[list[Sequence], Stats]:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InvalidArgumentError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 0")
    draft_len = draft_len or DraftLength(0)
    ctx = target.max_context
    for i, p in enumerate(prompts):
        if not p:
            raise InvalidArgumentError(f"prompt {i} is empty: at least one token is needed")
        if len(p) >= ctx:
            raise ContextLengthError(f"prompt {i} has {len(p)} tokens; the model's context (max_context) is {ctx}")
        bad = [t for t in p if not (0 <= t < target.cfg.vocab_size)]
        if bad:
            raise InvalidArgumentError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {target.cfg.vocab_size})")
    t0 = time.perf_counter()
    capacity = min(ctx, max(len(p) for p in prompts) + max_new_tokens + draft_len.max_k + 1)
    cache = target.new_cache(len(prompts), capacity)
    seqs = [Sequence(i, list(p), len(p), params[i], max_new_tokens, draft_len.k0) for i, p in enumerate(prompts)]
    total = Stats(prompt_tokens=sum(len(p) for p in prompts))
    if drafter is not None:
        drafter.begin(len(prompts), capacity)

    # Prefill: every prompt in one forward; logits only at each prompt's last row.
    tok, slot, pos, last = [], [], [], []
    for s in seqs:
        tok += s.tokens
        slot += [s.slot] * len(s.tokens)
        pos += range(len(s.tokens))
        last.append(len(tok) - 1)
    live = [s for s in seqs if s.max_new > 0]
    if live:
        logits = target.forward(torch.tensor(tok), torch.tensor(slot), torch.tensor(pos), cache, torch.tensor(last))
        total.forward_passes += 1
        for s in live:
            t = pick(logits[s.slot], s.params, len(s.tokens), s.tokens)
            _emit(s, _commit(s, [t], eos, capacity), on_token)
    for s in seqs:
        if s.max_new == 0:
            s.finish_reason = "length"
    total.prefill_time = time.perf_counter() - t0

    while live := [s for s in seqs if s.finish_reason is None]:
        # Never draft past the token budget or the cache: the verify yields up to k + 1 tokens.
        ks = [max(0, min(s.k, s.max_new - len(s.generated) - 1, capacity - len(s.tokens) - 1)) for s in live]
        drafts = [[] for _ in live]
        if drafter is not None and any(ks):
            drafts = drafter.propose([s.slot for s in live], [s.tokens for s in live], ks, [s.params for s in live])
        tok, slot, pos = [], [], []
        for s, d in zip(live, drafts):
            n = len(s.tokens)
            tok += [s.tokens[-1]] + d
            slot += [s.slot] * (len(d) + 1)
            pos += range(n - 1, n + len(d))
        logits = target.forward(torch.tensor(tok), torch.tensor(slot), torch.tensor(pos), cache)
        total.forward_passes += 1
        total.steps += 1
        r = 0
        for s, d in zip(live, drafts):
            rows = logits[r: r + len(d) + 1]
            r += len(d) + 1
            n = len(s.tokens)
            choice = pick_rows(rows, s.params, range(n, n + len(d) + 1), s.tokens, d)
            a = 0
            while a < len(d) and d[a] == choice[a]:
                a += 1
            if drafter is not None:
                drafter.accepted(s.slot, a)
            s.stats.count_step(len(d), a)
            s.k = draft_len.update(s.k, len(d), a)
            _emit(s, _commit(s, d[:a] + [choice[a]], eos, capacity), on_token)
            cache.lengths[s.slot] = len(s.tokens) - 1

    total.wall_time = time.perf_counter() - t0
    for s in seqs:
        s.stats.new_tokens = len(s.generated)
        s.stats.prompt_tokens = s.prompt_len
        s.stats.forward_passes = s.stats.steps + (1 if s.max_new > 0 else 0)
        s.stats.wall_time = total.wall_time
        s.stats.prefill_time = total.prefill_time
        total.new_tokens += s.stats.new_tokens
        total.proposed += s.stats.proposed
        total.accepted += s.stats.accepted
        for i, (p, a) in enumerate(zip(s.stats.proposed_at, s.stats.accepted_at)):
            total.count_position(i, p, a)
    total.draft_forward_passes = drafter.forward_passes if drafter is not None else 0
    for s in seqs:
        s.stats.draft_forward_passes = total.draft_forward_passes
    return seqs, total


def _emit(s: Sequence, new: list[int], on_token: OnToken | None) -> None:
    if on_token is not None and new:
        on_token(s.slot, new)
