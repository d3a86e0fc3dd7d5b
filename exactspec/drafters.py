"""Drafters propose tokens; the target decides. Nothing a drafter does can change the output.

Protocol (knows only token ids and slots):
  begin(n_slots, capacity)                 a new batch of sequences, one slot each
  propose(slots, seqs, ks, params) -> list of up to ks[i] draft tokens for seqs[i]
  accepted(slot, n)                        n of the last proposal were accepted
  release(slot)                            the slot's sequence left; the slot may get a new one
A drafter may return fewer tokens than asked (the lookup found nothing; low confidence).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from . import kernels as K
from .errors import InvalidArgumentError
from .model import Transformer, int64s
from .sampling import SamplingParams, pick


class Drafter(Protocol):
    forward_passes: int

    def begin(self, n_slots: int, capacity: int) -> None: ...

    def propose(self, slots: list[int], seqs: list[list[int]], ks: list[int],
                params: list[SamplingParams]) -> list[list[int]]: ...

    def accepted(self, slot: int, n: int) -> None: ...

    def release(self, slot: int) -> None: ...


class LookupDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n = max_ngram down to min_ngram) and propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (1 <= min_ngram <= max_ngram):
            raise InvalidArgumentError(f"lookup n-gram sizes: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.forward_passes = 0

    def begin(self, n_slots: int, capacity: int) -> None:
        pass

    def accepted(self, slot: int, n: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def propose(self, slots, seqs, ks, params) -> list[list[int]]:
        return [self.lookup(s, k) for s, k in zip(seqs, ks)]

    def lookup(self, seq: Sequence[int], k: int) -> list[int]:
        L = len(seq)
        if k <= 0 or L < 2:
            return []
        a = np.asarray(seq, dtype=np.int64)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            tail = a[L - n:]
            # candidate starts i < L - n with a[i:i+n] == tail, latest first
            win = np.lib.stride_tricks.sliding_window_view(a[: L - 1], n)  # (L - n, n)
            hits = np.flatnonzero((win == tail).all(axis=1))
            if hits.size:
                i = int(hits[-1]) + n
                return a[i: i + k].tolist()
        return []


class DraftModelDrafter:
    """A smaller model with its own KV cache. Each proposal first feeds the tokens of the sequence
    that its cache lacks (rolling back to the longest common prefix), then drafts one token at a
    time with the same sampling rule as the target, so with the same seed it guesses the same
    Gumbel-coupled samples. `confidence` > 0 stops drafting once the draft's probability of its
    own pick falls below it (like transformers' assistant_confidence_threshold)."""

    def __init__(self, model: Transformer, confidence: float = 0.0):
        if not (0.0 <= confidence < 1.0):
            raise InvalidArgumentError(f"draft confidence={confidence!r}: must be in [0, 1)")
        self.model, self.confidence = model, confidence
        self.forward_passes = 0

    def begin(self, n_slots: int, capacity: int) -> None:
        self.cache = self.model.new_cache(n_slots, capacity)
        self.cached: list[list[int]] = [[] for _ in range(n_slots)]  # token ids whose keys are in the cache
        self.known: list[int] = [0] * n_slots  # cached[:known] is a committed prefix (committed ids never change)

    def accepted(self, slot: int, n: int) -> None:
        pass  # rollback happens lazily in propose, by common prefix

    def release(self, slot: int) -> None:
        self.cached[slot].clear()
        self.known[slot] = 0

    def propose(self, slots, seqs, ks, params) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
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
            tok, slot, pos, last = [], [], [], []
            for i in live:
                s, start = slots[i], len(self.cached[slots[i]])
                ids = feed[i]
                tok += ids
                slot += [s] * len(ids)
                pos += range(start, start + len(ids))
                last.append(len(tok) - 1)
                self.cached[s].extend(ids)
            logits = self.model.forward(int64s(tok), int64s(slot), int64s(pos), self.cache, int64s(last))
            self.forward_passes += 1
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
