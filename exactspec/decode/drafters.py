"""Drafters propose tokens; the target decides. Nothing a drafter does can change the output.

Protocol (knows only token ids and slots):
  begin(n_slots, capacity)                 a new batch of sequences, one slot each
  propose(slots, seqs, ks, params) -> list of up to ks[i] draft tokens for seqs[i]
  release(slot)                            the slot's sequence left; the slot may get a new one
  observe(slot, start, hidden)             (drafters with wants_hidden) the target's final-normed
                                           states of positions start, start + 1, ... of the slot's
                                           sequence, from the forward that verified them
  alternatives(slot) -> runners-up for the first token of the slot's last draft (tree verification)
  evidence(slot) -> the length of the match a lookup's last draft for the slot copied (None: not a
                                           lookup's); with num_draft_tokens="auto" the loop prices it
A drafter may return fewer tokens than asked (the lookup found nothing; low confidence; the
sequence outgrew a draft model's context). What was accepted it learns from the next `seqs`.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np
from numba import njit

from .. import kernels as K
from ..errors import InvalidRequest
from ..model.transformer import Rows, Transformer
from .cost import (Acceptance, DraftCost, calibration, draft_drift, observe_drafting, one_row_seconds, row_seconds,
                   seen, step_seconds)
from .sampling import SamplingParams, pick


EXTEND = 16  # how far back a lookup follows a match (past that, the evidence classes of cost.py are one)
NAMED = ("lookup", "pool", "head")  # drafters chosen by name (draft="lookup"); "head:PATH" too; else a draft model


def is_named(draft: object) -> bool:
    """A drafter chosen by name ("lookup", "pool", "head", "head:PATH", or two joined by "+": "head+lookup"),
    not a draft model to load."""
    return isinstance(draft, str) and all(p in NAMED or p.startswith("head:") for p in draft.split("+"))


class Drafter:
    """The base: keeps no per-slot state (begin and release do nothing); counts its forwards."""
    forward_passes: int = 0
    wants_hidden: bool = False  # the loop asks the target's forward for hidden states, and calls observe
    # asking costs nothing, or the drafter prices its own drafts: with num_draft_tokens="auto" the loop asks
    # for the most tokens every step (and prices lookups' drafts by their evidence)
    free: bool = False

    def begin(self, n_slots: int, capacity: int) -> None:
        pass

    def propose(self, slots: list[int], seqs: list[list[int]], ks: list[int],
                params: list[SamplingParams]) -> list[list[int]]:
        raise NotImplementedError

    def release(self, slot: int) -> None:
        pass

    def observe(self, slot: int, start: int, hidden: np.ndarray) -> None:
        pass

    def cost_per_token(self, target: Transformer) -> float:
        """Drafting one token, in units of one target forward of one row (lookups: nothing)."""
        return 0.0

    def catch_up(self, target: Transformer) -> float:
        """Feeding a committed token it has not seen (past the one each step's first forward holds: the
        accepted drafts, the tokens committed while it paused), in the same unit (lookups: nothing)."""
        return 0.0

    def cost(self, target: Transformer) -> DraftCost:
        return DraftCost(self.cost_per_token(target), self.catch_up(target))

    @property
    def seen(self) -> Acceptance | None:
        """A model drafter's acceptance over the recent steps of every sequence it drafted for (shared by
        the drafters of one model: cost.seen); None for drafters priced otherwise."""
        return None

    def alternatives(self, slot: int) -> list[int]:
        """Runners-up for the first token of the slot's last draft, best first (tree verification checks
        them beside it); none by default."""
        return []

    def evidence(self, slot: int) -> int | None:
        """For a lookup's last draft for slot: how many of the sequence's last tokens the occurrence it
        copied from matched (up to EXTEND + n-gram); None for other drafts."""
        return None


def extend(a: np.ndarray, end: int, src: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """For occurrences src[starts[j]: starts[j] + n] of a's last n tokens (a[end - n: end]): how many
    tokens before each also match those before a's (up to EXTEND)."""
    back = np.arange(1, EXTEND + 1)
    theirs, ours = starts[:, None] - back, end - n - back
    ok = (theirs >= 0) & (ours >= 0)
    eq = ok & (src[np.maximum(theirs, 0)] == a[np.maximum(ours, 0)])
    return np.cumprod(eq, axis=1).sum(axis=1)


class LookupDrafter(Drafter):
    """Prompt lookup: find the earlier occurrences of the sequence's last n tokens (n = max_ngram down
    to min_ngram), and of those the one whose match goes furthest back (the latest of equals); propose
    the tokens that followed it. How far the match went is its evidence (`evidence`): the longer, the
    likelier the copy goes on."""
    free = True
    LATEST = 64  # occurrences compared (the latest)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (1 <= min_ngram <= max_ngram):
            raise InvalidRequest(f"lookup n-gram sizes: need 1 <= min_ngram ({min_ngram}) <= max_ngram "
                                 f"({max_ngram})", "lookup_max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.matched: dict[int, int] = {}  # slot -> its last draft's evidence

    def propose(self, slots, seqs, ks, params) -> list[list[int]]:
        out = []
        for slot, seq, k in zip(slots, seqs, ks):
            d, self.matched[slot] = self.find(seq, k)
            out.append(d)
        return out

    def evidence(self, slot: int) -> int | None:
        return self.matched.get(slot)

    def release(self, slot: int) -> None:
        self.matched.pop(slot, None)

    def find(self, seq: Sequence[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens, how many tokens the match they continue spans; 0: none found)."""
        if k <= 0 or len(seq) < 2:
            return [], 0
        a = np.asarray(seq, dtype=np.int64)
        i, m = longest_match(a, self.max_ngram, self.min_ngram, self.LATEST)
        return (a[i: i + k].tolist(), m) if i >= 0 else ([], 0)


@njit(cache=True, nogil=True)
def longest_match(a: np.ndarray, max_ngram: int, min_ngram: int, latest: int) -> tuple[int, int]:
    """The lookup's choice in a: for n = max_ngram down to min_ngram, the occurrences of a's last n tokens
    that a token follows (the `latest` last of them); of those, the one whose match goes furthest back
    (EXTEND tokens at most), the latest of equals. Returns (where its continuation starts, the match's
    length n + how far back it went), or (-1, 0): none. (A loop, not numpy's windows: it runs every
    decode step, and its ~100 us of numpy calls were 3-4% of a SmolLM2 step.)"""
    L = a.shape[0]
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        best, best_more, hits = -1, -1, 0
        for i in range(L - 1 - n, -1, -1):  # latest first: a[i: i + n] with a token after it
            j = 0
            while j < n and a[i + j] == a[L - n + j]:
                j += 1
            if j < n:
                continue
            more = 0
            while more < EXTEND and i - 1 - more >= 0 and a[i - 1 - more] == a[L - n - 1 - more]:
                more += 1
            if more > best_more:
                best, best_more = i, more
            hits += 1
            if hits == latest:
                break
        if best >= 0:
            return best + n, n + best_more
    return -1, 0


def from_prediction(pred: Sequence[int], out: Sequence[int], k: int, max_ngram: int = 4) -> list[int]:
    """Predicted Outputs (OpenAI's `prediction`): up to k tokens of the caller's guess at the output,
    from where the output stands in it. The output's last n tokens (n = max_ngram down to 1) are found
    in the prediction; of their occurrences, the one ending nearest len(out) (edits shift the output
    against the prediction a little; a repeated line must not send the draft back to its first
    copy). Before the first token: the prediction's start. Nothing found: no draft."""
    if k <= 0 or not pred:
        return []
    if not out:
        return list(pred[:k])
    p, o = np.asarray(pred, dtype=np.int64), np.asarray(out[-max_ngram:], dtype=np.int64)
    for n in range(min(max_ngram, len(o), len(p) - 1), 0, -1):
        win = np.lib.stride_tricks.sliding_window_view(p[:-1], n)  # n-grams with a token after them
        ends = np.flatnonzero((win == o[len(o) - n:]).all(axis=1)) + n
        if ends.size:
            i = int(ends[np.argmin(np.abs(ends - len(out)))])
            return p[i: i + k].tolist()
    return []


class NgramPool:
    """Token sequences that finished (prompts and outputs of every request), indexed by their
    n-grams (n = max_ngram down to min_ngram): for a suffix, the tokens that followed it in the newest
    sequence that has it (its first occurrence there: the longest continuation). Bounded: the oldest
    sequences leave when the pool holds more than `max_tokens`."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_tokens: int = 1 << 18):
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens
        self.seqs: dict[int, list[int]] = {}  # id -> tokens, oldest first
        self.index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (seq id, position after it)
        self.tokens = 0
        self._next = 0

    def add(self, seq: Sequence[int]) -> None:
        seq = list(seq)
        if len(seq) < 2:
            return
        sid, self._next = self._next, self._next + 1
        self.seqs[sid] = seq
        self.tokens += len(seq)
        first: dict[tuple[int, ...], tuple[int, int]] = {}  # inside a sequence the first occurrence (the
        for key, end in self._ngrams(seq):                  # longest continuation), across them the newest
            first.setdefault(key, (sid, end))
        self.index.update(first)
        while self.tokens > self.max_tokens and len(self.seqs) > 1:
            old = next(iter(self.seqs))
            gone = self.seqs.pop(old)
            self.tokens -= len(gone)
            for key, _ in self._ngrams(gone):
                if self.index.get(key, (None,))[0] == old:
                    del self.index[key]

    def _ngrams(self, seq: list[int]):
        """(n-gram, the position after it) for every n-gram with a token after it."""
        for n in range(self.min_ngram, self.max_ngram + 1):
            for i in range(len(seq) - n):
                yield tuple(seq[i:i + n]), i + n

    def find(self, seq: Sequence[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens, how many of seq's last tokens the occurrence they follow matches; 0: none)."""
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            hit = self.index.get(tuple(seq[len(seq) - n:]))
            if hit is not None:
                src, i = self.seqs[hit[0]], hit[1]
                if k <= 0:
                    return [], 0
                mine, lo = np.asarray(seq[-(n + EXTEND):], np.int64), max(0, i - n - EXTEND)
                more = extend(mine, len(mine), np.asarray(src[lo:i], np.int64), np.array([i - n - lo]), n)
                return src[i:i + k], n + int(more[0])
        return [], 0


class PoolDrafter(LookupDrafter):
    """Prompt lookup first; where the sequence's own tokens offer fewer than k tokens, the n-gram pool
    of the sequences that finished before it, if it offers more (shared by all requests of a server,
    or all calls of a Model): a repeated question, a document quoted again, code edited twice."""

    def __init__(self, pool: NgramPool):
        super().__init__(pool.max_ngram, pool.min_ngram)
        self.pool = pool
        self.live: dict[int, list[int]] = {}  # slot -> its sequence's tokens (the loop's own list)

    def propose(self, slots, seqs, ks, params) -> list[list[int]]:
        out = []
        for slot, seq, k in zip(slots, seqs, ks):
            self.live[slot] = seq
            own = self.find(seq, k)
            pooled = self.pool.find(seq, k) if 0 < k and len(own[0]) < k else ([], 0)
            d, self.matched[slot] = pooled if len(pooled[0]) > len(own[0]) else own
            out.append(d)
        return out

    def release(self, slot: int) -> None:
        super().release(slot)
        seq = self.live.pop(slot, None)
        if seq is not None:
            self.pool.add(seq)


class DraftModelDrafter(Drafter):
    """A smaller model with its own KV cache. Each proposal first feeds the tokens of the sequence
    that its cache lacks (rolling back to the longest common prefix), then drafts one token at a
    time with the same sampling rule as the target, so with the same seed it guesses the same
    Gumbel-coupled samples. `confidence` > 0 stops drafting once the draft's probability of its
    own pick falls below it (like transformers' assistant_confidence_threshold). A sequence longer
    than the draft's context gets fewer drafts, then none: the target goes on alone."""

    def __init__(self, model: Transformer, confidence: float = 0.0):
        if not (0.0 <= confidence < 1.0):
            raise InvalidRequest(f"draft_confidence={confidence!r}: must be in [0, 1)", "draft_confidence")
        self.model, self.confidence = model, confidence
        self.forward_passes = self.rows_fed = 0

    def begin(self, n_slots: int, capacity: int) -> None:
        self.cache = self.model.new_cache(n_slots, capacity)
        self.cached: list[list[int]] = [[] for _ in range(n_slots)]  # token ids whose keys are in the cache
        self.known: list[int] = [0] * n_slots  # cached[:known] is a committed prefix (committed ids never change)

    @property
    def seen(self) -> Acceptance:
        return seen(self.model)

    def cost_per_token(self, target: Transformer) -> float:
        """A draft forward as drafting pays it (its calibrated forward times its drift: the tokens it feeds,
        its pick) over a one-row forward of the target as the loop runs it."""
        return one_row_seconds(self.model) * draft_drift(self.model).factor(0) / step_seconds(target)

    def catch_up(self, target: Transformer) -> float:
        """A further row of its forward (calibrated, times its drift) over a one-row target forward in use."""
        return row_seconds(self.model) * draft_drift(self.model).factor(0) / step_seconds(target)

    def release(self, slot: int) -> None:
        self.cached[slot].clear()
        self.known[slot] = 0
        self.cache.release(slot)

    def propose(self, slots, seqs, ks, params) -> list[list[int]]:
        t, before, fed = time.perf_counter(), self.forward_passes, self.rows_fed
        out = self._propose(slots, seqs, ks, params)
        observe_drafting(self.model, time.perf_counter() - t, self.forward_passes - before,  # (cost_per_token)
                         self.rows_fed - fed, calibration(self.model))
        return out

    def _propose(self, slots, seqs, ks, params) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        # the i-th draft token is fed at position len(seq) + i - 1: stay inside the draft's cache
        ks = [min(k, self.cache.capacity - len(seq) + 1) for k, seq in zip(ks, seqs)]
        live = [i for i, k in enumerate(ks) if k > 0]
        feed: dict[int, list[int]] = {}
        for i in live:
            s, seq, c = slots[i], seqs[i], self.cached[slots[i]]
            n = min(self.known[s], len(c))
            while n < len(c) and n < len(seq) - 1 and c[n] == seq[n]:
                n += 1
            del c[n:]  # roll back: keys past n are stale
            feed[i] = seq[n:]
            self.known[s] = len(seq)
        while live:
            rows = Rows()
            for i in live:
                c = self.cached[slots[i]]
                rows.add(slots[i], feed[i], len(c))
                c.extend(feed[i])
            logits = rows.forward(self.model, self.cache)
            self.forward_passes += 1
            self.rows_fed += len(rows.tok)
            probs = K.softmax(logits) if self.confidence > 0 else None
            nxt = []
            for r, i in enumerate(live):
                hist = seqs[i] + out[i]
                t = pick(logits[r], params[i], len(hist), hist)
                if probs is not None and out[i] and float(probs[r, t]) < self.confidence:
                    continue  # not confident: stop drafting this sequence (keep at least one)
                out[i].append(t)
                if len(out[i]) < ks[i]:
                    feed[i] = [t]
                    nxt.append(i)
            live = nxt
        return out
