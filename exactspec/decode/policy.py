"""The speculation policy, in one place: how many tokens a sequence drafts at each step, how a free
draft (a lookup's, the request's prediction) is cut to the length worth verifying, how many of a
head's runners-up to verify beside it, when to pause drafting and probe again, and what each verify
teaches. Only speed depends on any of it: the tokens are plain decoding's whatever it decides.

One `Policy` per sequence. The loop calls, per sequence and step: `ask` (tokens to ask the drafter
for), `take` (the draft to verify, a free one cut to its worth), `siblings` (tree verification)
before the forward, and `learn` after the verify. The rules, by `num_draft_tokens` (`DraftLength`, checked in request.py):
- k: k tokens every step.
- "dynamic": grow by 2 after a fully accepted draft, shrink by 1 after a rejection (transformers'
  rule); after a rejected one-token draft pause 1, 2, 4 ... 32 steps, an accepted token ends it.
- "auto" (cost.py): drafts that cost nothing to ask for (lookups, the prediction, and MixDrafter,
  which prices its own) are asked for max_k tokens every step and cut by the sequence's acceptance of
  drafts with the same evidence; for a model drafter, the k with the most expected tokens per unit of
  time from the sequence's acceptance, its cost per token and the measured verify costs; none worth
  it: pause 1, 2, 4 ... 32 steps, or as long as makes the probe and its catch-up cheap (cost.probe_pause),
  then probe with one token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .cost import PAUSE_MAX, Acceptance, ByEvidence, DraftCost, best_k, best_siblings, probe_pause
from .request import DraftLength


@dataclass
class Backoff:
    """Pauses of 1, 2, 4 ... PAUSE_MAX steps: `pause()` gives the next one and doubles it; `reset()`
    after a draft pays again. (Dynamic k, auto k and MixDrafter's probing of its model all pause so.)"""
    next: int = 1

    def pause(self) -> int:
        n, self.next = self.next, min(PAUSE_MAX, 2 * self.next)
        return n

    def reset(self) -> None:
        self.next = 1


@dataclass
class Policy:
    """One sequence's drafting state. `drafting`: a drafter or a prediction may propose tokens; `free`:
    its drafts cost nothing to ask for (lookups, the prediction) or the drafter prices them itself."""
    length: DraftLength  # the request's num_draft_tokens
    drafting: bool
    free: bool = False
    k: int = 0  # tokens to ask for at the next step (fixed, dynamic, or auto's choice)
    skip: int = 0  # steps to go without drafting
    backoff: Backoff = field(default_factory=Backoff)
    acceptance: Acceptance = field(default_factory=Acceptance)  # recent, per draft token
    by_evidence: ByEvidence = field(default_factory=ByEvidence)  # free drafts' acceptance by match length
    evidence: int | None = None  # this step's draft: a lookup's of this match length (-1: the prediction's)
    predicted: bool = False  # this step's draft came from the request's prediction
    # per sibling verified (tree verification); a runner-up is seldom the target's token (SmolLM2's head:
    # 19 of 193 in bench/head.py), so the prior is low
    sibling_rate: Acceptance = field(default_factory=lambda: Acceptance(prior=0.1))
    # the drafter's acceptance over every sequence's recent steps (Drafter.seen): a new sequence starts from
    # it, not from a blind 0.5 (a draft model accepted 35% of the time lost 3% in its first steps of each chat)
    seen: Acceptance | None = None
    # lookup drafts' acceptance by evidence over every sequence's recent steps (cost.seen_lookups): the same
    seen_lookups: ByEvidence | None = None

    def __post_init__(self) -> None:
        self.k = self.length.k0 if self.drafting else 0
        if self.seen is not None:
            self.acceptance = Acceptance(prior=self.seen.alpha)
        if self.seen_lookups is not None:
            self.by_evidence = ByEvidence.starting_from(self.seen_lookups)

    @property
    def asks_most(self) -> bool:
        """auto with free drafts: ask for max_k every step, then cut the draft (`take`)."""
        return self.length.auto and self.free

    def ask(self, room: Callable[[int], int]) -> int:
        """Tokens to ask the drafter for this step; room(k) caps k to the token budget and the cache."""
        k = room(self.length.max_k) if self.asks_most else 0 if self.skip else room(self.k)
        self.skip = max(0, self.skip - 1)
        return k

    def take(self, draft: list[int], guess: list[int], evidence: Callable[[], int | None],
             costs: Callable[[], np.ndarray]) -> list[int]:
        """The draft to verify: the prediction's `guess` where it offers at least as many tokens as the
        drafter's `draft`; with auto and free drafts, cut to the length with the most expected tokens per
        unit of time from this sequence's acceptance of drafts of the same evidence (the lookup's match
        length, `evidence()`; -1 for the prediction; None: the drafter priced it)."""
        self.predicted = bool(guess) and len(guess) >= len(draft)
        if self.predicted:
            draft = guess
        self.evidence = None
        if not draft or not self.asks_most:
            return draft
        m = -1 if self.predicted else evidence()
        if m is None:
            return draft
        alpha = self.acceptance.alpha if m < 0 else self.by_evidence.alpha(m)
        draft = draft[:best_k(alpha, costs(), 0.0, len(draft))]
        self.evidence = m if draft else None
        return draft

    def siblings(self, n: int, most: int, costs: np.ndarray, drafting: float) -> int:
        """How many of the drafter's runners-up for the first of n draft tokens to verify beside them."""
        return best_siblings(self.acceptance.alpha, self.sibling_rate.alpha, n, most, costs, drafting)

    def learn(self, proposed: int, accepted: int, per_draft: Callable[[], DraftCost],
              costs: Callable[[], np.ndarray]) -> None:
        """After a verify of `proposed` draft tokens of which `accepted` were the target's: the next k
        and pause. per_draft(): the drafter's costs; costs(): the verify costs at this length."""
        L = self.length
        if L.dynamic and proposed:
            self.k = min(L.max_k, self.k + 2) if accepted == proposed else max(1, self.k - 1)
            if accepted:
                self.backoff.reset()
            elif proposed == 1:  # a rejected one-token draft: drafting costs more than it saves here
                self.skip = self.backoff.pause()
        if not proposed:
            return
        if self.evidence is not None and self.evidence >= 0:
            self.by_evidence.add(self.evidence, proposed, accepted)
            if self.seen_lookups is not None:
                self.seen_lookups.add(self.evidence, proposed, accepted)
        elif L.auto:
            self.acceptance.add(proposed, accepted)
            if self.seen is not None and not self.predicted:
                self.seen.add(proposed, accepted)
            if self.asks_most:  # free drafts are asked for the most every step and cut (`take`)
                return
            self._choose(per_draft() if not self.predicted else DraftCost(), costs())

    def begin(self, per_draft: Callable[[], DraftCost], costs: Callable[[], np.ndarray]) -> None:
        """Before the first step: with auto and a model drafter that drafted for earlier sequences, the
        first k from its acceptance there (`seen`), not a blind 4."""
        known = self.seen is not None and self.seen.accepted + self.seen.rejected > 0
        if self.length.auto and self.drafting and not self.free and known:
            self._choose(per_draft(), costs())

    def _choose(self, cost: DraftCost, costs: np.ndarray) -> None:
        k = best_k(self.acceptance.alpha, costs, cost.per_draft, self.length.max_k, cost.per_token)
        if k:
            self.k = k
            self.backoff.reset()
        else:  # none worth drafting: pause, then probe with one token (not before the probe is cheap enough)
            self.k, self.skip = 1, max(self.backoff.pause(), probe_pause(self.acceptance.alpha, costs, cost))
