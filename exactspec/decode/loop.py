"""The decoding loop: prefill, propose, verify, accept, roll back. Plain decoding is this loop
with no drafter (k = 0). Batches of sequences of any lengths go through one target forward per
step, each sequence accepting its own number of tokens.

Takes validated `Request`s (request.py) and trusts them: nothing here re-checks an input.

Invariant kept by the loop: a sequence's cache holds keys for all of its tokens but the last;
each step feeds [last token] + drafts at positions len-1, len, ..., and afterwards the valid
length is len(tokens) - 1 again (the rollback: rejected drafts' keys are left as garbage, and the
next step overwrites them).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from .chunking import Chunker
from .constraint import Matcher, masked
from .cost import DraftCost, observe_step, seen_lookups, verify_costs
from .drafters import Drafter, from_prediction
from ..errors import GenerationError, InvalidRequest
from ..kernels.attention import BLOCK
from ..model.prefix import PrefixCache
from ..model.transformer import Rows, Transformer
from .policy import Policy
from .request import Request
from .sampling import pick, pick_rows, processed_logits, token_logprobs
from .seq import SeqState
from .stats import BatchStats


class Batch:
    """Sequences decoded together, one target forward per `step`. Sequences join (`add`) and
    leave (finish, `cancel`) between steps: continuous batching. A step feeds the prompt of each
    newly added sequence (whole, or its next `prefill_chunk` tokens: a long prompt then shares its
    steps with the others' decoding, and a cancel stops it at the next chunk) and [last token] +
    drafts of each running one, in one forward. Thanks to batch invariance no sequence's tokens
    depend on what else is in the batch, nor on how its prompt was chunked: a position's keys and
    values are a function of its prefix alone, whichever step wrote them."""

    def __init__(self, target: Transformer, n_slots: int, capacity: int, drafter: Drafter | None = None,
                 prefill_chunk: int = 0, prefix_blocks: int = 0, branches: int = 1):
        """`branches` > 1: tree verification, up to branches - 1 siblings of each draft's first token
        (the drafter's runners-up) verified in the same forward where they pay (cost.best_siblings)."""
        for name, v, low in (("prefill_chunk", prefill_chunk, 0), ("prefix_blocks", prefix_blocks, 0),
                             ("draft_branches", branches, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidRequest(f"{name}={v!r}: must be an integer >= {low}{'' if low else ' (0: off)'}", name)
        self.target, self.drafter, self.prefill_chunk = target, drafter, prefill_chunk
        self.capacity = min(capacity, target.max_context)
        self.branches = branches if drafter is not None else 1
        helpers = n_slots * (self.branches - 1)
        # (a sequence's next rows start at its committed length: its rows only move forward)
        self.cache = target.new_cache(n_slots, self.capacity, prefix_blocks, helpers, forward_only=True)
        self._helpers = list(range(n_slots, n_slots + helpers))  # free helper slots (tree verification)
        self._sibs: list[tuple[int, int, int]] = []  # this step's siblings: (index in old, helper slot, token)
        self.prefix = PrefixCache(self.cache, prefix_blocks) if prefix_blocks else None
        self.chunker = Chunker(target, prefill_chunk)
        self._ends: list[int] = []  # this step's prompt chunk ends, one per new sequence
        self._free = list(range(n_slots - 1, -1, -1))
        self.seqs: list[SeqState] = []
        self.stats = BatchStats()
        if drafter is not None:
            drafter.begin(n_slots, self.capacity)

    @property
    def has_room(self) -> bool:
        return bool(self._free)

    @property
    def running(self) -> list[SeqState]:
        return [s for s in self.seqs if s.finish_reason is None]

    def add(self, req: Request, tag: object = None) -> SeqState:
        """Join the batch (prefilled at the next step). The request was validated by make_request."""
        if not self._free:
            raise GenerationError("Batch.add: no free slot (check has_room first)")
        forced = req.constraint is not None  # forced text: free drafts (decode/constraint.py)
        free = self.drafter.free if self.drafter is not None else bool(req.prediction) or forced
        policy = Policy(req.draft_len, drafting=self.drafter is not None or bool(req.prediction) or forced, free=free,
                        seen=self.drafter.seen if self.drafter is not None else None,
                        seen_lookups=seen_lookups(self.target) if self.drafter is not None else None)
        s = SeqState(req, self._free.pop(), list(req.prompt), policy, tag)
        policy.begin(self._per_draft, lambda: self._costs(s))
        if forced:
            s.matcher = Matcher(req.constraint)
        s.stats.prompt_tokens, s.stats.seed = len(req.prompt), req.params.seed if not req.params.greedy else None
        self.stats.sequences += 1
        if req.max_new_tokens == 0:
            s.finish_reason = "length"
        elif self.prefix is not None:  # a cached prefix: its blocks are shared, its prefill starts after them
            blocks = self.prefix.match(req.cache_scope, req.prompt)
            for i, (b, local) in enumerate(blocks):
                self.cache.share(s.slot, i, b, local)
            s.kept = len(blocks)
            s.fed = s.stats.cached_tokens = len(blocks) * BLOCK
        self.seqs.append(s)
        return s

    def cancel(self, s: SeqState) -> None:
        if s.finish_reason is None:
            s.finish_reason = "cancelled"
            self.stats.cancelled += 1
            self.stats.cancelled_tokens += len(s.generated)
        self._release()

    def step(self) -> list[tuple[SeqState, list[int]]]:
        """One target forward. Returns (sequence, tokens it committed) for each; sequences that
        finished (see `finish_reason`) have left the batch when it returns. An exception while
        stepping one sequence ends that sequence only (finish_reason "error", `error` set)."""
        live = self.running
        out = self._step(live) if live else []
        if self.prefix is not None:  # full blocks written by this step join the prefix cache
            for s in live:
                n = s.cached // BLOCK
                if n > s.kept and s.finish_reason != "error":
                    self.prefix.insert(s.req.cache_scope, s.tokens, s.slot, n)
                    s.kept = n
        self._release()  # finished sequences leave now; their slots take the next arrivals
        return out

    def _step(self, live: list[SeqState]) -> list[tuple[SeqState, list[int]]]:
        # If the shared part (drafting, the forward) raises, every sequence is stepped again
        # alone: batch invariance makes that the same tokens, and only one that fails alone fails.
        # (Keys a failed forward wrote are past the valid lengths: garbage that is overwritten.)
        new = [s for s in live if not s.prefilled]
        old = [s for s in live if s.prefilled]
        try:
            drafts = self._propose(old)
            self._ends, busy = self.chunker.plan(new, old)
            rows = self._rows(new, old, drafts)
            hidden = None  # every row's final-normed state, for a drafter that reads them (decode/head.py)
            if self.drafter is not None and self.drafter.wants_hidden:
                hidden = np.empty((len(rows.tok), self.target.cfg.hidden_size), np.float32)
            t0 = time.perf_counter()
            logits = rows.forward(self.target, self.cache, hidden=hidden)
            took = time.perf_counter() - t0
        except Exception as e:
            self._drop_siblings()
            if len(live) > 1:
                return [x for s in live for x in self._step([s])]
            self._fail(live[0], e)
            return [(live[0], [])]
        self.stats.forward_passes += 1
        try:
            if len(old) == 1 and not new and not self._sibs:  # what a decode step's forward took (cost.py)
                observe_step(self.target, len(rows.tok), len(old[0].tokens), took)
            return self._accept(new, old, drafts, logits, busy, hidden)
        finally:
            self._drop_siblings()

    def _fail(self, s: SeqState, e: Exception) -> None:
        s.finish_reason, s.error = "error", e
        self.stats.failed += 1

    # -- the steps of `step` ------------------------------------------------------------------
    def _propose(self, old: list[SeqState]) -> list[list[int]]:
        """Draft tokens for each running sequence, as long as its policy says (decode/policy.py): the
        drafter's, or the request's prediction where it offers at least as many; a head's runners-up
        beside them where they pay (tree verification)."""
        ks = [s.policy.ask(lambda k, s=s: self._room(s, k)) for s in old]
        drafts: list[list[int]] = [[] for _ in old]
        if self.drafter is not None and any(ks):
            before = self.drafter.forward_passes
            drafts = self.drafter.propose([s.slot for s in old], [s.tokens for s in old], ks,
                                          [s.req.params for s in old])
            self.stats.draft_forward_passes += self.drafter.forward_passes - before
        for i, (s, k) in enumerate(zip(old, ks)):
            guess = from_prediction(s.req.prediction, s.generated, k) if s.req.prediction else []
            drafts[i] = s.policy.take(drafts[i], guess, lambda s=s: self._evidence(s), lambda s=s: self._costs(s))
            s.guessed = len(drafts[i])
            if s.matcher is not None:  # the grammar's forced text, the guesses it allows (none: no drafts)
                limit = self._room(s, s.req.draft_len.max_k) if s.policy.drafting and s.req.draft_len.max_k else 0
                drafts[i], s.guessed = s.matcher.draft(drafts[i], limit)
                continue  # (no siblings: a runner-up is priced without the grammar)
            if drafts[i] and not s.policy.predicted and self.branches > 1:
                alts = [t for t in self.drafter.alternatives(s.slot) if t != drafts[i][0]]
                n, most = len(drafts[i]), min(len(alts), self.branches - 1)
                j = s.policy.siblings(n, most, self._costs(s), n * self.drafter.cost_per_token(self.target))
                for t in alts[:j]:
                    self._sibs.append((i, self._helpers.pop(), t))
        return drafts

    def _room(self, s: SeqState, k: int) -> int:
        """k, or fewer: never past the token budget or the cache (a verify yields up to k + 1 tokens)."""
        return max(0, min(k, s.req.max_new_tokens - len(s.generated) - 1, self.capacity - len(s.tokens) - 1))

    def _costs(self, s: SeqState) -> np.ndarray:
        """The verify costs of 1 .. k + 1 rows at this sequence's length (measured once per model)."""
        return verify_costs(self.target, len(s.tokens))

    def _evidence(self, s: SeqState) -> int | None:
        return self.drafter.evidence(s.slot) if self.drafter is not None else None

    def _drop_siblings(self) -> None:
        for _, h, _ in self._sibs:
            self.cache.release(h)
            self._helpers.append(h)
        self._sibs = []

    def _rows(self, new: list[SeqState], old: list[SeqState], drafts: list[list[int]]) -> Rows:
        rows = Rows()
        for s, end in zip(new, self._ends):  # the prompt (or its next chunk): only its last row's logits
            chunk = s.tokens[s.fed: end]
            rows.add(s.slot, chunk, s.fed, logits_from=None if end == len(s.tokens) else len(chunk))
        for s, d in zip(old, drafts):  # [last token] + drafts at positions len-1, len, ...
            rows.add(s.slot, [s.tokens[-1]] + d, len(s.tokens) - 1, logits_from=0)
        for i, h, t in self._sibs:  # [last token, sibling] in a copy of the sequence's cache
            s = old[i]
            self.cache.fork(s.slot, h, len(s.tokens) - 1)
            rows.add(h, [s.tokens[-1], t], len(s.tokens) - 1, logits_from=0)
        return rows

    def measure(self) -> None:
        """Measure now what chunking and num_draft_tokens="auto" use (once per model, well under a
        second for SmolLM2): a server does it at start, not inside a request's step."""
        self.chunker.measure()
        verify_costs(self.target)
        if self.drafter is not None:
            self.drafter.cost(self.target)

    def _accept(self, new: list[SeqState], old: list[SeqState], drafts: list[list[int]],
                logits: torch.Tensor, busy: list[bool], hidden: np.ndarray | None = None
                ) -> list[tuple[SeqState, list[int]]]:
        """Pick the target's token at every row; keep the drafts up to the first disagreement. The
        states of the rows whose prefix is now committed go to the drafter, if it reads them."""
        out, r, h = [], 0, 0  # r: logits row, h: forward row
        for s, end, b in zip(new, self._ends, busy):
            if b:
                self.chunker.spend(s, end)
            if hidden is not None:
                self.drafter.observe(s.slot, s.fed, hidden[h: h + end - s.fed])
                h += end - s.fed
            s.fed = end
            if not s.prefilled:  # a chunk of the prompt: no logits yet
                out.append((s, []))
                continue
            i, r = r, r + 1
            allowed = None
            try:
                if s.matcher is not None:
                    new, _, allowed = self._pick_constrained(s, logits[i: i + 1], [])
                else:
                    new = [pick(logits[i], s.req.params, len(s.tokens), s.tokens)]
            except Exception as e:  # nothing of s was changed: fail s alone
                self._fail(s, e)
                out.append((s, []))
                continue
            out.append((s, self._commit(s, new, logits[i: i + 1], allowed)))
        sibs: dict[int, list[tuple[int, int, int, int]]] = {}  # old index -> (logits row, forward row, helper, token)
        chains = sum(len(d) + 1 for d in drafts)
        rs, hs = r + chains, h + chains  # the siblings' rows come after the chains'
        for i, slot, t in self._sibs:
            sibs.setdefault(i, []).append((rs, hs, slot, t))
            rs, hs = rs + 2, hs + 2
        for i, (s, d) in enumerate(zip(old, drafts)):
            n = len(s.tokens)
            rows = logits[r: r + len(d) + 1]
            r += len(d) + 1
            h += len(d) + 1
            won, allowed = [], None
            try:
                if s.matcher is not None:  # row by row under the grammar (no siblings: see _propose)
                    new, a, allowed = self._pick_constrained(s, rows, d)
                else:
                    choice = pick_rows(rows, s.req.params, range(n, n + len(d) + 1), s.tokens, d)
                    won = [x for x in sibs.get(i, ()) if x[3] == choice[0]]
                    a = 0
                    while a < len(d) and d[a] == choice[a]:
                        a += 1
                    new = d[:a] + [choice[a]]
                    if won:  # a sibling was the target's token: its row picks the next one
                        new = [choice[0], pick(logits[won[0][0] + 1], s.req.params, n + 1, s.tokens + [choice[0]])]
            except Exception as e:
                self._fail(s, e)
                out.append((s, []))
                continue
            for x in sibs.get(i, ()):
                s.policy.sibling_rate.add(1, int(x[3] == new[0]))
                s.stats.siblings += 1
            if won:  # the sibling's keys (position n) become the sequence's: its block is swapped in
                _, fr, slot, _ = won[0]
                s.stats.sibling_accepted += 1
                self.cache.swap(s.slot, slot, n // BLOCK)
                if hidden is not None:
                    self.drafter.observe(s.slot, n - 1, hidden[fr: fr + 2])
                rows = torch.stack([rows[0], logits[won[0][0] + 1]])
            elif hidden is not None:  # positions n-1 .. n-1+a: their prefixes are committed
                self.drafter.observe(s.slot, n - 1, hidden[h - len(d) - 1: h - len(d) + a])
            s.stats.count_step(len(d), a)
            if s.policy.predicted:
                s.stats.prediction_accepted += a
                s.stats.prediction_rejected += len(d) - a
            # the drafter's guesses only (forced text is certain: it would teach the policy nothing)
            s.policy.learn(s.guessed, min(a, s.guessed), self._per_draft, lambda s=s: self._costs(s))
            out.append((s, self._commit(s, new, rows, allowed)))
        return out

    @staticmethod
    def _pick_constrained(s: SeqState, rows: torch.Tensor, d: list[int]) -> tuple[list[int], int, list[np.ndarray]]:
        """Row by row under the grammar's mask of that row's own prefix: the drafts up to the first the
        target disagrees with, then its token; or up to the draft that completes the grammar (nothing may
        follow it: plain decoding stops there too). Returns the tokens to commit, how many are drafts, and
        each one's mask; the matcher is left after them."""
        n, out, allowed = len(s.tokens), [], []
        while True:
            j = len(out)
            allowed.append(s.matcher.mask())
            t = pick(masked(rows[j], allowed[-1]), s.req.params, n + j, s.tokens + d[:j])
            out.append(t)
            if t not in s.matcher.g.vocab.eos:
                s.matcher.advance([t])
            if j == len(d) or t != d[j]:
                return out, j, allowed
            if s.matcher.done:
                return out, j + 1, allowed

    def _per_draft(self) -> DraftCost:
        """The drafter's costs per draft token and per token it catches up on, in one-row forwards (0 without one)."""
        return self.drafter.cost(self.target) if self.drafter is not None else DraftCost()

    def _commit(self, s: SeqState, new: list[int], rows: torch.Tensor, allowed: list[np.ndarray] | None = None
                ) -> list[int]:
        """Append tokens until a stop; returns the ones appended. rows[i]: the logits that predicted new[i];
        allowed[i]: the grammar's mask there (a constrained request)."""
        kept = []
        for t in new:
            s.tokens.append(t)
            kept.append(t)
            if t in s.req.eos or s.matcher is not None and (t in s.matcher.g.vocab.eos or
                                                              len(kept) == len(new) and s.matcher.done):
                s.finish_reason = "stop"  # EOS, or the grammar is complete (nothing may follow)
            elif len(s.generated) >= s.req.max_new_tokens or len(s.tokens) >= self.capacity:
                s.finish_reason = "length"
            if s.finish_reason:
                break
        if s.req.logprobs is not None and kept:
            if s.req.logprobs_mode == "processed":  # each row with the history before its token (and its mask)
                base = len(s.tokens) - len(kept)
                rows = torch.stack([processed_logits(masked(rows[i], allowed[i]) if allowed else rows[i], s.req.params,
                                                     s.tokens[:base + i]) for i in range(len(kept))])
            s.logprobs += token_logprobs(rows, kept, s.req.logprobs)
        now = time.perf_counter()
        st = s.stats
        st.forward_passes += 1
        if not st.new_tokens:
            st.time_to_first_token = now - s.joined_at
        st.new_tokens += len(kept)
        self.stats.new_tokens += len(kept)
        return kept

    def _release(self) -> None:
        now = time.perf_counter()
        for s in [s for s in self.seqs if s.finish_reason is not None]:
            s.stats.wall_time = now - s.joined_at
            self.seqs.remove(s)
            self._free.append(s.slot)
            self.cache.release(s.slot)
            if self.drafter is not None:
                self.drafter.release(s.slot)


OnToken = Callable[[object, list[int]], None]  # (the sequence's tag, new token ids)


def run_batch(target: Transformer, reqs: list[Request], drafter: Drafter | None = None,
              on_token: OnToken | None = None, branches: int = 1) -> tuple[list[SeqState], BatchStats]:
    """Decode a fixed batch to the end: all requests join at once (tag = their index), the loop
    steps until none runs. `branches`: see Batch."""
    t0 = time.perf_counter()
    capacity = max((len(r.prompt) + r.max_new_tokens for r in reqs), default=1)
    batch = Batch(target, max(1, len(reqs)), capacity, drafter, branches=branches)
    seqs = [batch.add(r, tag=i) for i, r in enumerate(reqs)]
    while batch.running:
        for s, new in batch.step():
            if on_token is not None and new:
                on_token(s.tag, new)
    batch.stats.wall_time = time.perf_counter() - t0
    return seqs, batch.stats
