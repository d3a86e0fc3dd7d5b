"""Choosing a token from a row of logits: greedy argmax, or seeded Gumbel-max sampling.

Contract: `pick(logits, params, position, history)` is a pure function of its arguments. The noise
for sampling comes from a counter-based hash of (seed, absolute position, token id), so the token
at a position is the same whichever drafter proposed it, whatever k, alone or batched (Daliri,
Musco, Suresh 2024: drafter-invariant speculative decoding). argmax(z/T + Gumbel) is an exact
sample of softmax(z/T) restricted to the tokens the filters keep.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch
from numba import njit

from .. import kernels as K
from ..errors import InvalidRequest


MIN_TEMPERATURE = 1e-5  # below it (and above 0), sampling is greedy: documented, as vLLM's _SAMPLING_EPS


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (so is anything below 1e-5)"})
    top_k: int = field(default=0, metadata={"help": "keep the k likeliest tokens (0 = off)"})
    top_p: float = field(default=1.0, metadata={"help": "keep the likeliest tokens whose mass reaches p"})
    min_p: float = field(default=0.0, metadata={"help": "drop tokens below min_p x the likeliest's probability"})
    repetition_penalty: float = field(default=1.0, metadata={"help": "divide the logits of tokens seen before"})
    # None: greedy ignores it; sampling draws one at make_request (`resolved`)
    seed: int | None = field(default=0, metadata={"help": "the sampling seed (the same seed, the same tokens)"})

    def __post_init__(self) -> None:
        def number(name: str, ok, rule: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise InvalidRequest(f"{name}={v!r}: {rule}", name)
        number("temperature", lambda v: v >= 0, "must be a finite number >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / 1e-45 overflow: greedy, as vLLM does
            object.__setattr__(self, "temperature", 0.0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = off)", "top_k")
        number("top_p", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
        number("min_p", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
        number("repetition_penalty", lambda v: v > 0, "must be a finite number > 0")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not (0 <= self.seed < 2 ** 63)):
            raise InvalidRequest(f"seed={self.seed!r}: must be an integer in [0, 2**63) or None", "seed")

    def resolved(self) -> "SamplingParams":
        """These params with a seed: a fresh one drawn for sampling with seed None (reported in the
        result's stats, so the run replays), 0 for greedy (which never uses it)."""
        if self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63) if self.temperature else 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_M64 = (1 << 64) - 1


@njit(cache=True, nogil=True)
def _splitmix(z):
    z = (z + np.uint64(0x9E3779B97F4A7C15))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True)
def _gumbel(seed, position, n, out):
    key = _splitmix(_splitmix(np.uint64(seed)) ^ np.uint64(position))
    for i in range(n):
        bits = _splitmix(key + np.uint64(i)) >> np.uint64(11)  # 53 random bits
        u = (np.float64(bits) + 0.5) * (1.0 / 9007199254740992.0)  # in (0, 1)
        out[i] = -math.log(-math.log(u))
    return out


def gumbel_noise(seed: int, position: int, n: int) -> np.ndarray:
    """(n,) float64 standard Gumbel noise, a pure function of (seed, position, index)."""
    return _gumbel(seed, position, n, np.empty(n, np.float64))


@njit(cache=True, nogil=True)
def _greedy_penalized(z, history, inv, rp):
    # argmax of filtered_logits(z, repetition penalty only): tokens seen in the history are divided
    # by the penalty when positive (torch computes `s / rp` as s * (1 / rp) in float32, and so do
    # we) or multiplied by it; the first index of the maximum wins, as in torch.argmax.
    V = z.shape[0]
    seen = np.zeros(V, np.bool_)
    for t in history:
        if 0 <= t < V:
            seen[t] = True
    best = np.float32(-np.inf)
    arg = 0
    for i in range(V):
        v = z[i]
        if seen[i]:
            v = v * inv if v > 0 else v * rp
        if v > best:
            best = v
            arg = i
    return arg


def filtered_logits(logits: torch.Tensor, p: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    """(V,) float32 -> (V,) float32 z/T with filtered-out tokens at -inf. Row-local, deterministic."""
    z = logits.clone()
    if p.repetition_penalty != 1.0 and len(history):
        ids = torch.tensor(sorted(set(history)), dtype=torch.long)
        ids = ids[ids < z.shape[0]]
        s = z[ids]
        z[ids] = torch.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
    z = z / p.temperature
    if p.top_k and p.top_k < z.shape[0]:
        kth = torch.topk(z, p.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if p.top_p < 1.0 or p.min_p > 0.0:
        probs = K.softmax(z[None])[0]
        if p.min_p > 0.0:
            z = z.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_p < 1.0:
            order = torch.sort(probs, descending=True, stable=True).indices
            before = K.cumsum(probs[order]) - probs[order]  # mass of the tokens ranked above
            drop = order[before >= p.top_p]
            z[drop] = float("-inf")
    return z


def processed_logits(logits: torch.Tensor, p: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    """The distribution a token was picked from, as logits: filtered_logits (penalty, temperature,
    top-k/top-p/min-p) for sampling; for greedy the repetition penalty only (temperature 1)."""
    if p.greedy:
        p = replace(p, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    return filtered_logits(logits, p, history)


def pick(logits: torch.Tensor, p: SamplingParams, position: int, history: Sequence[int]) -> int:
    """The token at absolute `position` given the logits row predicting it."""
    if p.greedy and p.repetition_penalty == 1.0:  # (numpy's argmax: the same first maximum, 10x faster here)
        return int(np.argmax(logits.numpy()))
    if p.greedy:
        rp = np.float32(p.repetition_penalty)
        return int(_greedy_penalized(logits.numpy(), np.array(history, np.int64), np.float32(1.0) / rp, rp))
    z = filtered_logits(logits, p, history).double().numpy()
    return int(np.argmax(z + gumbel_noise(p.seed, position, z.shape[0])))


def pick_rows(logits: torch.Tensor, p: SamplingParams, positions: Sequence[int],
              history: list[int], drafts: Sequence[int]) -> list[int]:
    """Choices for consecutive rows: row i predicts position positions[i] after history + drafts[:i]."""
    if p.greedy and p.repetition_penalty == 1.0:
        return np.argmax(logits.numpy(), axis=-1).tolist()
    return [pick(logits[i], p, positions[i], history + list(drafts[:i])) for i in range(logits.shape[0])]


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's distribution (raw: log_softmax of its logits;
    processed: of the logits after the sampling filters), and the `top` most likely tokens there."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """logits (n, V) of consecutive positions, tokens (n,) the tokens at them -> their logprobs.
    Row-local and computed by our kernel (fixed order), so a position's logprob is a function of
    its prefix alone, like its logits: the same in plain decoding, a verify chunk or a scoring pass."""
    lp = K.log_softmax(logits[: len(tokens)]).numpy()
    out = []
    for row, t in zip(lp, tokens):
        alt = ()
        if top:
            best = np.argsort(-row, kind="stable")[:top]  # ties: the lower id first
            alt = tuple((int(i), float(row[i])) for i in best if row[i] > -np.inf)  # filtered out: not listed
        out.append(TokenLogprob(int(t), float(row[t]), alt))
    return out
