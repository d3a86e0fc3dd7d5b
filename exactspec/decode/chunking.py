"""How much of a new sequence's prompt one step feeds (chunked prefill). The tokens never depend on
it (a position's keys are a function of its prefix, whichever step wrote them); the latency of the
other requests does. A step takes the time of its rows' linear work plus their attention (a row at
position p reads p + 1 keys), and a request that arrives waits for the step in flight, so:

- a prompt is fed `prefill_chunk` tokens per step;
- alone, a chunk's attention stays within PREFILL_IDLE_ATTENTION one-row forwards (at least one row);
- a long prompt (> `long_prompt` tokens) sharing its step with others (decoding sequences, or a
  shorter prompt) carries at most the rows that keep the step within 1 + PREFILL_STEP_SHARE one-row
  forwards, and its attention within a credit that grows by PREFILL_ATTENTION_SHARE one-row forwards
  per step: its late chunks take several steps' credit instead of slowing every step of the others.

Costs are measured on the model (decode/cost.py), once, because counting multiply-adds misses what
attention spends on exp (~6x low on SmolLM2 Q4_1).
"""
from __future__ import annotations

import numpy as np

from ..model.transformer import Transformer
from .cost import attention_cost, verify_costs
from .seq import SeqState

PREFILL_ATTENTION_SHARE = 0.25  # beside others: a long prompt's attention per step, in one-row forwards
PREFILL_IDLE_ATTENTION = 10.0  # alone: a step's prompt attention (a newcomer waits for it), in one-row forwards
PREFILL_STEP_SHARE = 0.5  # beside others: a long prompt's rows may add this share to a one-row forward's time
LONG_PROMPT = 256  # prompts longer than this are held back beside other work (shorter ones: only chunked)


class Chunker:
    def __init__(self, target: Transformer, prefill_chunk: int):
        self.target, self.prefill_chunk = target, prefill_chunk
        self.long_prompt = LONG_PROMPT
        self.step_share = PREFILL_STEP_SHARE  # 0: no row cap beside others (the attention credit only)
        self._grants: tuple[int, int] | None = None
        self._rows: int | None = None

    def plan(self, new: list[SeqState], old: list[SeqState]) -> tuple[list[int], list[bool]]:
        """Where each new sequence's feed ends this step, and whether it is held back (`busy`).
        Decided once per step, before any `fed` moves."""
        busy = [self.prefill_chunk > 0 and len(s.req.prompt) > self.long_prompt and _shares(s, new, old)
                for s in new]
        return [self._end(s, b) for s, b in zip(new, busy)], busy

    def _end(self, s: SeqState, busy: bool) -> int:
        n = len(s.tokens)
        if not self.prefill_chunk:
            return n
        end = min(n, s.fed + self.prefill_chunk)
        if not busy:  # a step a newcomer may wait for: its attention bounded (at least one row)
            e, cost = s.fed + 1, s.fed + 1
            while e < end and cost + e + 1 <= self.grants[1]:
                cost += e + 1
                e += 1
            return e
        if self.step_share:
            end = min(end, s.fed + self.rows_beside())
        e, cost, budget = s.fed, 0, s.credit + self.grants[0]
        while e < end and cost + e + 1 <= budget:
            cost += e + 1
            e += 1
        return e

    def spend(self, s: SeqState, end: int) -> None:
        """A held-back prompt fed up to `end`: its credit pays for the chunk's attention; it keeps at
        most what its next row needs."""
        grant = self.grants[0]
        left = s.credit + grant - (end * (end + 1) - s.fed * (s.fed + 1)) // 2
        s.credit = min(left, max(grant, end + 1))

    def measure(self) -> None:
        """Measure now what chunking uses (once per model), not inside a request's step."""
        if self.prefill_chunk:
            self.rows_beside()
            self.grants

    @property
    def grants(self) -> tuple[int, int]:
        """Key positions a chunk's attention may read per step: held back, and alone."""
        if self._grants is None:
            per_key = max(attention_cost(self.target), 1e-9)  # in one-row forwards
            self._grants = tuple(max(1, int(share / per_key))
                                 for share in (PREFILL_ATTENTION_SHARE, PREFILL_IDLE_ATTENTION))
        return self._grants

    def rows_beside(self) -> int:
        """The most prompt rows whose forward beside one decoding row costs at most 1 + step_share
        one-row forwards (at least one)."""
        if self._rows is None:
            costs = verify_costs(self.target)  # costs[n]: a forward of n + 1 rows over one of 1 row
            self._rows = max(1, int(np.searchsorted(costs, 1.0 + self.step_share, side="right")) - 1)
        return self._rows


def _shares(s: SeqState, new: list[SeqState], old: list[SeqState]) -> bool:
    """Whether s's chunk shares its step with work it must not delay: decoding sequences, or a prompt
    with fewer tokens left than s's (a newcomer beside a long prompt is fed whole, not slowed by it)."""
    left = len(s.tokens) - s.fed
    return bool(old) or any(len(o.tokens) - o.fed < left for o in new if o is not s)
