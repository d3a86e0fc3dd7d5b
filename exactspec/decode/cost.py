"""The draft length by cost (num_draft_tokens="auto"): how much a verify of k drafts costs this model,
measured once, and the k that maximizes expected tokens per unit of time given a sequence's recent
acceptance. Only speed depends on it: the target decides every token whatever k is.

A verify of k drafts is one target forward of k + 1 rows; each draft is accepted with probability
alpha given the ones before it (a geometric model), so it yields 1 + alpha + ... + alpha^k tokens
and costs costs[k] (that forward over a 1-row forward) + k x per_draft (a draft model's own forward
per token; 0 for lookup and predictions).

The costs are calibrated once per model (a few dozen bare forwards, interleaved) and then corrected by
what the loop's forwards really take (`Drifts`): a calibration taken during a slow spell of a shared
machine is off by 10% or more, and a draft model's step with its feeding and picking costs 1.7-2.4x its
bare forward (measured on SmolLM2 on a Zen 4: a calibration under load priced a second row at 0.03 of
a forward, the loop paid 0.13-0.22). Draft lengths chosen from such numbers drafted at a loss (issue 55).
"""
from __future__ import annotations

import time
import weakref
import bisect
import math
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ..model.transformer import Rows, Transformer

MAX_K = 16
FAR = 512  # the longer context the verify costs are measured at
_MEASURED = (1, 2, 3, 5, 9, MAX_K + 1)  # row counts timed; the others interpolated
_COSTS: "weakref.WeakKeyDictionary[Transformer, tuple]" = weakref.WeakKeyDictionary()
_ONE_ROW: "weakref.WeakKeyDictionary[Transformer, float]" = weakref.WeakKeyDictionary()
_ROW: "weakref.WeakKeyDictionary[Transformer, float]" = weakref.WeakKeyDictionary()
_ATTENTION: "weakref.WeakKeyDictionary[Transformer, float]" = weakref.WeakKeyDictionary()
DRIFT_DECAY = 0.9  # a drift follows about the last 10 steps
DRIFT_PRIOR = 3.0  # the calibration counts as this many steps
DECAY = 0.8  # acceptance is counted over about the last 1 / (1 - DECAY) = 5 verify steps
PAUSE_MAX = 32  # k = 0 pauses drafting for 1, 2, 4, ... 32 steps (or longer: probe_pause), then probes with one draft
PROBE_SHARE = 0.02  # a paused drafter's probe may cost at most this share of the steps it waited
NEVER = 1 << 30  # a pause for the rest of the sequence


def fastest(run: Callable[[], object], repeat: int = 3) -> float:
    """Seconds: the fastest of `repeat` calls of `run`, after one to warm (a first call may compile)."""
    run()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def _probe(net: Transformer, n: int, at: int = 32) -> Callable[[], object]:
    """A forward of n rows of one sequence at positions at.. (their attention reads at + 1.. keys), ready to
    time: its cache holds the keys before them, written once (a forward reads only written blocks)."""
    cache = net.new_cache(1, at + n)
    if at:
        keys = Rows()
        keys.add(0, [1] * at, 0)
        keys.forward(net, cache)
    rows = Rows()
    rows.add(0, [1] * n, at, logits_from=0)
    return lambda: rows.forward(net, cache)


def _seconds(net: Transformer, n: int, at: int = 32) -> float:
    return fastest(_probe(net, n, at))


def interleaved(runs: list[Callable[[], object]], repeat: int = 5) -> np.ndarray:
    """Seconds: each run's fastest of `repeat`, timed round by round (every run once a round, after one
    round to warm), so that a slow spell of a shared machine hits them all alike."""
    for run in runs:
        run()
    best = np.full(len(runs), np.inf)
    for _ in range(repeat):
        for i, run in enumerate(runs):
            t = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def attention_cost(net: Transformer) -> float:
    """A key position's attention (all layers and heads: scores, exp, values) in units of one
    one-row forward, measured once per model from a row at position 32 and one at 512."""
    if net not in _ATTENTION:
        far = min(512, net.max_context - 1)
        near = min(32, far // 2)
        t_far, t_near = _seconds(net, 1, far), _seconds(net, 1, near)
        _ATTENTION[net] = max(t_far - t_near, 0.0) / max(far - near, 1) / t_near
    return _ATTENTION[net]


def one_row(net: Transformer) -> Callable[[], object]:
    """A one-row forward at position 32, ready to time (decode/head.py times its draft step beside it)."""
    return _probe(net, 1)


def one_row_seconds(net: Transformer) -> float:
    if net not in _ONE_ROW:
        _ONE_ROW[net] = _seconds(net, 1)
    return _ONE_ROW[net]


def row_seconds(net: Transformer) -> float:
    """A further row's seconds in a forward of many at position 32 (a forward of 33 rows less one of 1, over
    32): what a drafter pays per token it catches up on (committed tokens it has not fed yet)."""
    if net not in _ROW:
        one, many = interleaved([_probe(net, 1), _probe(net, 33)])
        _ROW[net] = max(many - one, 0.0) / 32
    return _ROW[net]


def _far(net: Transformer) -> int:
    """The second context the verify costs are measured at (32, none, for a model too short for one)."""
    return max(32, min(FAR, net.max_context - MAX_K - 1))


def _verify_seconds(net: Transformer) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of a forward of each of _MEASURED row counts at 32 and at _far(net) positions."""
    if net not in _COSTS:
        ats = (32, _far(net)) if _far(net) > 32 else (32,)
        t = interleaved([_probe(net, n, at) for at in ats for n in _MEASURED]).reshape(len(ats), len(_MEASURED))
        _COSTS[net] = (t[0], t[-1])
    return _COSTS[net]


class Drifts:
    """How much longer things take in use than their calibration said, one entry each: the decayed
    geometric mean of measured / calibrated seconds, from the calibration's 1 worth DRIFT_PRIOR samples.
    A sample's ratio is clipped to [1/3, 3]: one compile or preemption must not decide the next steps."""

    def __init__(self, n: int) -> None:
        self.log, self.weight = np.zeros(n), np.full(n, DRIFT_PRIOR)

    def add(self, i: int, measured: float, calibrated: float) -> None:
        if measured > 0 and calibrated > 0:
            x = min(max(math.log(measured / calibrated), -_CLIP), _CLIP)
            self.weight[i] = DRIFT_DECAY * self.weight[i] + 1.0
            self.log[i] += (x - self.log[i]) / self.weight[i]

    def factor(self, i: int) -> float:
        return math.exp(self.log[i])


_CLIP = math.log(3.0)
_DRIFTS: "weakref.WeakKeyDictionary[Transformer, Drifts]" = weakref.WeakKeyDictionary()


def drifts(net: Transformer) -> Drifts:
    """[k]: the drift of the forward of a decode step of k + 1 rows of one sequence from its calibration
    (shared by every loop that runs the model)."""
    if net not in _DRIFTS:
        _DRIFTS[net] = Drifts(MAX_K + 1)
    return _DRIFTS[net]


_LINES: "weakref.WeakKeyDictionary[Transformer, tuple]" = weakref.WeakKeyDictionary()


def _calibrated(net: Transformer, context: int) -> np.ndarray:
    """(MAX_K + 1,) [k]: the calibrated seconds of a forward of k + 1 rows after `context` positions: at 32
    positions, plus the growth per position to _far(net), each interpolated between the measured row counts
    once (this runs every decode step: np.interp each time was ~0.1 ms of a 5 ms step)."""
    measured = _verify_seconds(net)
    if net not in _LINES or _LINES[net][0] is not measured:
        near, far = measured
        span = _far(net) - 32
        rows = np.arange(1, MAX_K + 2)
        growth = np.maximum(far - near, 0.0) / span if span > 0 else np.zeros_like(near)  # per position
        _LINES[net] = (measured, np.interp(rows, _MEASURED, near), np.interp(rows, _MEASURED, growth))
    _, at32, per_position = _LINES[net]
    return at32 + max(context - 32, 0) * per_position


def observe_step(net: Transformer, rows: int, context: int, seconds: float) -> None:
    """A decode step's forward of one sequence took `seconds` for `rows` rows ([last token] + drafts) at
    `context` positions: its drift from the calibration is learned (decode/loop.py calls this). Not before the
    model's costs were calibrated: plain decoding never pays for that."""
    if 1 <= rows <= MAX_K + 1 and net in _COSTS:
        drifts(net).add(rows - 1, seconds, float(_calibrated(net, context)[rows - 1]))


_AS_DRAFT: "weakref.WeakKeyDictionary[Transformer, Drifts]" = weakref.WeakKeyDictionary()


def draft_drift(net: Transformer) -> Drifts:
    """[0]: the drift of a draft model's forward in drafting (feeding, picking) from its calibrated
    one-row forward."""
    if net not in _AS_DRAFT:
        _AS_DRAFT[net] = Drifts(1)
    return _AS_DRAFT[net]


_SEEN: "weakref.WeakKeyDictionary[Transformer, Acceptance]" = weakref.WeakKeyDictionary()


def seen(net: Transformer) -> "Acceptance":
    """A drafting model's (a draft model's, a head's) acceptance over the recent verify steps of every
    sequence it drafted for: where a new sequence's acceptance starts (decode/policy.py)."""
    if net not in _SEEN:
        _SEEN[net] = Acceptance()
    return _SEEN[net]


_SEEN_LOOKUPS: "weakref.WeakKeyDictionary[Transformer, ByEvidence]" = weakref.WeakKeyDictionary()


def seen_lookups(net: Transformer) -> "ByEvidence":
    """Lookup drafts' acceptance by evidence over the recent verify steps of every sequence the target `net`
    wrote: where a new sequence's starts (`ByEvidence.starting_from`), as `seen` is for a drafting model.
    (From the fixed priors every short chat paid its first drafts of each class: at the AVX2 level, where a
    verified row costs ~0.5 of a forward, the demo's lookup lost 4% that way.)"""
    if net not in _SEEN_LOOKUPS:
        _SEEN_LOOKUPS[net] = ByEvidence()
    return _SEEN_LOOKUPS[net]


def calibration(net: Transformer) -> tuple[float, float] | None:
    """A draft model's calibrated (one-row forward, further row) seconds, if both were timed (observations
    before are not taken: timing it in the middle of a step that asked for no cost would cost that step)."""
    return (_ONE_ROW[net], _ROW[net]) if net in _ONE_ROW and net in _ROW else None


def observe_drafting(net: Transformer, seconds: float, forwards: int, rows: int,
                     calibrated: tuple[float, float] | None) -> None:
    """A drafter (a draft model, a head: `net`) took `seconds` for `forwards` draft forwards of `rows` rows in
    all, calibrated at (a one-row forward, a further row) seconds (None: not calibrated, nothing is learned).
    Rows past one a forward are its catch-up (the committed tokens it has not fed: after a pause, tens of
    them in its first forward) and other sequences' rows: priced per row, they are not drift of its step."""
    if forwards and calibrated:
        step, row = calibrated
        draft_drift(net).add(0, seconds, forwards * step + max(rows - forwards, 0) * row)


class DraftCost(NamedTuple):
    """A model drafter's costs in one-row target forwards as the loop runs them: `per_draft` a draft token's
    step, `per_token` each committed token it feeds later past the one a step's first forward holds (the
    states of accepted drafts, the tokens committed while it paused). Lookups and predictions: nothing."""
    per_draft: float = 0.0
    per_token: float = 0.0


def step_seconds(net: Transformer) -> float:
    """A one-row decode forward at position 32 as the loop runs it: the unit the costs are in."""
    return one_row_seconds(net) * drifts(net).factor(0)


def verify_costs(net: Transformer, context: int = 32) -> np.ndarray:
    """(MAX_K + 1,) costs[k]: a forward of k + 1 rows after `context` positions, over a one-row forward
    at 32 (so costs[0] >= 1 grows with the context: each row's attention reads every key before it),
    measured once per model at 32 and at 512 positions (about 70 forwards, interleaved), linear in the context
    between and beyond, interpolated between measured row counts, made non-decreasing in k. A verify
    of k drafts against a one-row step is costs[k] / costs[0] at the sequence's own length: at 300
    positions on SmolLM2 Q4_1 the rows' attention is ~1/3 of a short forward each. Each row count's
    cost is then multiplied by its drift over the one-row step's (what the loop's steps took,
    `observe_step`), so the unit is a one-row forward as the loop runs it."""
    d = drifts(net).log
    c = _calibrated(net, context) * np.exp(d - d[0]) / _verify_seconds(net)[0][0]
    return np.maximum.accumulate(np.maximum(c, 1.0))


def tokens_per_time(alpha: float, costs: np.ndarray, per_draft: float, max_k: int = MAX_K,
                    per_token: float = 0.0) -> np.ndarray:
    """[k] for k in 0..max_k: a verify of k drafts' expected tokens (1 + alpha + ... + alpha^k) over its cost:
    the forward, k draft steps, and (k > 0) the drafter's catch-up on all but one of those tokens (DraftCost)."""
    k = np.arange(min(max_k, len(costs) - 1) + 1)
    tokens = np.cumsum(alpha ** k)
    return tokens / (costs[k] + k * per_draft + (k > 0) * (tokens - 1.0) * per_token)


def best_k(alpha: float, costs: np.ndarray, per_draft: float, max_k: int = MAX_K, per_token: float = 0.0) -> int:
    """The k in 0..max_k with the most expected tokens per unit of time."""
    return int(np.argmax(tokens_per_time(alpha, costs, per_draft, max_k, per_token)))


def probe_pause(alpha: float, costs: np.ndarray, cost: DraftCost) -> int:
    """Steps to wait before probing a model drafter not worth its cost with one draft token: enough that the
    probe's expected loss (a verify of 2 rows and a draft step, against the plain steps of its 1 + alpha
    tokens) and its catch-up on every token committed while it waited (cost.per_token each) stay within
    PROBE_SHARE of the waited steps' time. NEVER when the catch-up alone costs more than that share: waiting
    longer does not help, as the catch-up grows with the wait (a bfloat16 draft model at the AVX2 level, 0.045
    of a forward a token, probed every 32 steps at 15% acceptance cost the demo 5-10%). The next sequence
    starts from the acceptance seen (`seen`)."""
    room = PROBE_SHARE * costs[0] - cost.per_token
    if room <= 0:
        return NEVER
    return math.ceil(max(costs[1] + cost.per_draft - (1.0 + alpha) * costs[0], 0.0) / room)


def best_siblings(alpha: float, rate: float, k: int, most: int, costs: np.ndarray, drafting: float) -> int:
    """Tree verification: how many (0..most) of a k-token draft's runners-up at its first position to verify
    beside it, the number with the most expected tokens per unit of time. A sibling costs 2 rows ([last
    token, sibling], in a helper slot holding a copy of the sequence's cache); when it is the target's
    token (each with probability `rate`, measured per sequence) the step commits one token more.
    `drafting`: the draft's own cost. (Measured on SmolLM2: a fork costs 0.03 ms, a sibling what 2 chain
    rows cost, bench/tree.py.)"""
    tokens = float(np.sum(alpha ** np.arange(k + 1)))
    best, best_v = 0, tokens / (costs[k] + drafting)
    for j in range(1, min(most, (len(costs) - 1 - k) // 2) + 1):
        v = (tokens + j * rate) / (costs[k + 2 * j] + drafting)
        if v > best_v:
            best, best_v = j, v
    return best


class Acceptance:
    """A sequence's recent acceptance: decayed counts of accepted drafts and of rejections, from a prior
    worth one count (0.5: either way)."""

    def __init__(self, prior: float = 0.5) -> None:
        self.accepted, self.rejected, self.prior = 0.0, 0.0, prior

    def add(self, proposed: int, accepted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (accepted < proposed)

    @property
    def alpha(self) -> float:
        """Per-draft acceptance (the prior before any step)."""
        return (self.accepted + self.prior) / (self.accepted + self.rejected + 1.0)


# A lookup's draft copies what followed an earlier occurrence of the sequence's last m tokens, and the
# longer that match the likelier the copy goes on. Measured on SmolLM2 (bench/head.py's 9 chats, their greedy
# answers, every position): the first copied token was the target's 18% of the time at m = 1, 33% at 2,
# 76% at 3, 66-78% at 4-6, ~90% at 7-11, 94% at 12+, and a copy that started right went on 2-16 tokens.
# So lookups are priced per class of m; the priors are those figures as per-draft-token acceptance.
EVIDENCE = (1, 2, 3, 4, 7, 12)  # class c: EVIDENCE[c] <= m < EVIDENCE[c + 1]
PRIORS = (0.3, 0.6, 0.8, 0.8, 0.9, 0.95)


class ByEvidence:
    """A sequence's acceptance of lookup drafts per class of evidence (the match length)."""

    def __init__(self, priors: Sequence[float] = PRIORS) -> None:
        self.acc = [Acceptance(p) for p in priors]

    @classmethod
    def starting_from(cls, seen: "ByEvidence") -> "ByEvidence":
        """A new sequence's: each class's prior is its acceptance in `seen` (earlier sequences)."""
        return cls([a.alpha for a in seen.acc])

    @staticmethod
    def of(m: int) -> int:
        return max(0, bisect.bisect_right(EVIDENCE, m) - 1)

    def alpha(self, m: int) -> float:
        return self.acc[self.of(m)].alpha

    def add(self, m: int, proposed: int, accepted: int) -> None:
        self.acc[self.of(m)].add(proposed, accepted)

    def length(self, m: int, n: int, costs: np.ndarray) -> int:
        """How many of a lookup's n tokens of evidence m to verify: the most expected tokens per unit of time."""
        return best_k(self.alpha(m), costs, 0.0, n)
