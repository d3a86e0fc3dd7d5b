"""The serving engine: one thread owns a continuous `Batch`; requests queue up (bounded), join the
batch when a slot frees, and receive their tokens through a callback as each step commits them.

Contract: a request's tokens are exactly those of `Model.generate` with the same prompt and
sampling parameters (batch invariance), whatever else is being decoded beside it.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .api import Model
from .decode import Batch, DraftLength, Sequence
from .drafters import Drafter
from .sampling import SamplingParams


class QueueFull(Exception):
    pass


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    max_new: int
    eos: frozenset[int]
    on_event: Callable[[list[int], str | None], None]  # (new tokens, finish_reason or None); engine thread
    created: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    seq: Sequence | None = None
    first_token_at: float | None = None


@dataclass
class EngineStats:  # what /metrics reports beside the server's own counters
    cancelled: int = 0  # client went away, or a stop string ended it early
    proposed: int = 0  # draft tokens, finished requests
    accepted: int = 0


class Engine:
    def __init__(self, model: Model, drafter: Drafter | None, num_draft_tokens: int | str, max_batch: int = 8,
                 max_queue: int = 64):
        self.model = model
        self.batch = Batch(model.net, max_batch, model.net.max_context, drafter,
                           DraftLength(num_draft_tokens if drafter is not None else 0))
        self.max_queue = max_queue
        self.queue: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []
        self.cv = threading.Condition()
        self.stats = EngineStats()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="exactspec-engine", daemon=True)
        self.thread.start()

    def submit(self, req: Request) -> None:
        self.batch.check_prompt(req.prompt)  # raises a clear error before the request queues
        with self.cv:
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"request queue is full ({self.max_queue} waiting)")
            self.queue.append(req)
            self.cv.notify()

    def cancel(self, req: Request) -> None:
        with self.cv:
            req.cancelled = True
            self.cv.notify()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify()
        self.thread.join(timeout=10)

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.active)

    def _finish(self, req: Request, reason: str | None) -> None:
        if req in self.active:
            self.active.remove(req)
        s = req.seq
        if s is not None:
            self.stats.proposed += s.stats.proposed
            self.stats.accepted += s.stats.accepted
        self.stats.cancelled += reason == "cancelled"
        if reason != "cancelled":
            req.on_event([], reason)

    def _admit(self) -> None:
        """Under the lock: drop cancelled requests, move queued ones into free slots."""
        for req in [r for r in self.queue if r.cancelled]:
            self.queue.remove(req)
            self._finish(req, "cancelled")
        for req in [r for r in self.active if r.cancelled]:
            self.batch.cancel(req.seq)
            self._finish(req, "cancelled")
        while self.queue and self.batch.free:
            req = self.queue.popleft()
            req.seq = self.batch.add(req.prompt, req.params, req.max_new, req.eos, tag=req)
            self.active.append(req)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopped and not self.queue and not self.active:
                    self.cv.wait()
                if self.stopped:
                    return
                self._admit()
            try:
                events = self.batch.step()
            except Exception as e:  # never leave clients hanging on an engine failure
                with self.cv:
                    for req in list(self.active):
                        self.batch.cancel(req.seq)
                        req.on_event([], f"error: {e}")
                        self._finish(req, "cancelled")
                continue
            now = time.perf_counter()
            with self.cv:
                for s, new in events:
                    req: Request = s.tag
                    if req.first_token_at is None and new:
                        req.first_token_at = now
                    if new and not req.cancelled:
                        req.on_event(new, None)
                    if s.finish_reason is not None:
                        self._finish(req, s.finish_reason)
