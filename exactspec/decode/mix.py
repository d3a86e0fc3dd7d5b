"""Prompt lookup beside a model drafter (head+lookup, draft model+pool, ...): per sequence and step, the source
with the most expected tokens per unit of time (decode/cost.py). Only speed depends on it."""
from __future__ import annotations

import numpy as np

from ..model.transformer import Transformer
from .cost import Acceptance, ByEvidence, DraftCost, probe_pause, seen_lookups, tokens_per_time, verify_costs
from .drafters import Drafter, LookupDrafter
from .policy import Backoff


class MixDrafter(Drafter):
    """Prompt lookup (or the pool) beside a model drafter (a head, a draft model), chosen per sequence and
    step by expected tokens per unit of time (decode/cost.py): each source's acceptance on this sequence,
    measured online (the lookup's per class of its evidence, `cost.ByEvidence`; the model's `cost.Acceptance`),
    the verify cost of k + 1 rows and the model's cost per draft token (lookups cost nothing to ask, so they
    are asked first, every step). The lookup's L tokens of evidence m are worth their best first n
    (1 + a + ... + a^n tokens for costs[n]); the model's best k' <= k, 1 + m + ... + m^k' for costs[k'] +
    k' x its cost per token (and its catch-up, cost.DraftCost); drafting nothing, 1 token for costs[0]. The best
    of the three is done; a model not worth asking is still asked for one token after 1, 2, 4, ... 32 steps, or
    as long as makes that probe cheap (cost.probe_pause): its acceptance may have changed. It prices its own
    drafts: with num_draft_tokens="auto" the loop asks for the most tokens."""
    free = True

    def __init__(self, lookups: LookupDrafter, model: Drafter, target: Transformer):
        self.lookups, self.model, self.target = lookups, model, target
        self.wants_hidden = model.wants_hidden

    @property
    def forward_passes(self) -> int:  # type: ignore[override]
        return self.model.forward_passes

    def begin(self, n_slots: int, capacity: int) -> None:
        self.lookups.begin(n_slots, capacity)
        self.model.begin(n_slots, capacity)
        self.acc = [self._fresh() for _ in range(n_slots)]  # (lookup, model) per slot
        self.last: list[tuple[int, int, list[int], int] | None] = [None] * n_slots  # (source, len(seq), draft, m)
        self.idle, self.backoff = [0] * n_slots, [Backoff() for _ in range(n_slots)]  # steps not asked; the wait

    def release(self, slot: int) -> None:
        self.lookups.release(slot)
        self.model.release(slot)
        self.acc[slot], self.last[slot] = self._fresh(), None
        self.idle[slot], self.backoff[slot] = 0, Backoff()

    def observe(self, slot: int, start: int, hidden: np.ndarray) -> None:
        self.model.observe(slot, start, hidden)

    def cost_per_token(self, target: Transformer) -> float:
        return self.model.cost_per_token(target)

    def catch_up(self, target: Transformer) -> float:
        return self.model.catch_up(target)

    def alternatives(self, slot: int) -> list[int]:
        last = self.last[slot]
        return self.model.alternatives(slot) if last is not None and last[0] == 1 else []

    def _fresh(self) -> tuple[ByEvidence, Acceptance]:
        """A new sequence's acceptances: where the earlier sequences' left them (cost.seen_lookups, cost.seen)."""
        model = self.model.seen
        return ByEvidence.starting_from(seen_lookups(self.target)), Acceptance(0.5 if model is None else model.alpha)

    def _learn(self, slot: int, seq: list[int]) -> None:
        """What the last proposal for slot got accepted: its agreement with the tokens that followed."""
        if self.last[slot] is None:
            return
        src, n, draft, m = self.last[slot]
        got = seq[n:n + len(draft)]
        a = next((i for i, (x, y) in enumerate(zip(draft, got)) if x != y), min(len(draft), len(got)))
        if src:
            self.acc[slot][1].add(len(draft), a)
            if self.model.seen is not None:
                self.model.seen.add(len(draft), a)
            if a:
                self.backoff[slot].reset()
        else:
            self.acc[slot][0].add(m, len(draft), a)
            seen_lookups(self.target).add(m, len(draft), a)
        self.last[slot] = None

    def choose(self, slot: int, free_len: int, m: int, k: int, context: int = 32, costs: np.ndarray | None = None,
               cost: DraftCost | None = None) -> tuple[int, int]:
        """(how many of the lookup's free_len tokens of evidence m to verify, how many tokens to ask the
        model for): at most one of them not 0; both 0: drafting is worth less than a plain step. For a
        sequence of `context` tokens (`costs`: its verify costs, `cost`: the model's, if known)."""
        costs = verify_costs(self.target, context) if costs is None else costs
        c = self.cost(self.target) if cost is None else cost
        lookups, model = self.acc[slot]
        n = lookups.length(m, free_len, costs) if free_len else 0
        free = tokens_per_time(lookups.alpha(m), costs, 0.0, n)[n]
        value = tokens_per_time(model.alpha, costs, c.per_draft, k, c.per_token)[1:]
        best = int(np.argmax(value)) if len(value) else -1
        return (0, best + 1) if best >= 0 and value[best] > free else (n, 0)

    def propose(self, slots, seqs, ks, params) -> list[list[int]]:
        for s, seq in zip(slots, seqs):
            self._learn(s, seq)
        out = self.lookups.propose(slots, seqs, ks, params)
        want = [0] * len(seqs)
        c = self.cost(self.target)  # once a step: every sequence's choice reads it
        for i, (s, seq, k) in enumerate(zip(slots, seqs, ks)):
            if k <= 0:
                continue
            costs = verify_costs(self.target, len(seq))
            n, want[i] = self.choose(s, len(out[i]), self.lookups.evidence(s) or 0, k, costs=costs, cost=c)
            out[i] = out[i][:n]
            if not n and not want[i]:  # neither pays: the model is asked for one token now and then
                self.idle[s] += 1
                if self.idle[s] >= max(self.backoff[s].next, probe_pause(self.acc[s][1].alpha, costs, c)):
                    want[i], self.idle[s] = 1, 0
                    self.backoff[s].pause()
        ask = [i for i, w in enumerate(want) if w]
        if ask:
            got = self.model.propose([slots[i] for i in ask], [seqs[i] for i in ask], [want[i] for i in ask],
                                     [params[i] for i in ask])
            for i, d in zip(ask, got):
                out[i] = d
        for i, (s, seq, d) in enumerate(zip(slots, seqs, out)):
            if d:
                self.last[s] = (1 if want[i] else 0, len(seq), d, self.lookups.evidence(s) or 0)
        return out
