"""The serving engine: one thread owns a continuous `Batch` of the target `Transformer`; jobs
queue up (bounded), join the batch when a slot frees, and receive their tokens through a
callback as each step commits them.

Contract: a job's tokens are exactly those of `Model.generate` with the same validated Request
(batch invariance), whatever else is being decoded beside it. The engine checks no input: a
Request is validated once, by request.make_request, before it is submitted.

One thread does all the numeric work: the engine thread allocates the KV cache, runs every step
and every scoring pass (`call`). OpenMP (libgomp, shared by numba's kernels and torch) gives each
thread that starts a parallel region its own pool of workers; once the pools hold more threads than
the machine has cores, every worker stops spinning at a barrier and sleeps, and each parallel
kernel pays a futex wake-up: on 2 cores a server whose main thread had zeroed the KV cache ran at
half the library's speed (docs/exactness.md, "Threads on two cores").

Faults: an exception while stepping one job ends that job only (Batch.step isolates it); the
job gets a GenerationError naming an error id, and the traceback goes to the log under that id.
Anything else that goes wrong in the loop fails the jobs it touched and the loop goes on; if the
thread dies all the same, `alive` turns False and `submit` refuses (the server answers 503).
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from ..decode.drafters import Drafter
from ..errors import ConstraintError, GenerationError
from ..kernels.threads import get_num_threads, set_num_threads
from ..decode.loop import Batch
from ..decode.seq import SeqState
from ..decode.stats import Stats
from ..model.transformer import Transformer
from ..decode.request import Request
from ..decode.sampling import TokenLogprob


log = logging.getLogger("exactspec.engine")


class QueueFull(Exception):
    pass


class EngineDown(Exception):
    pass


@dataclass
class Event:
    """What the engine tells a job (on the engine thread): new tokens, and at the end its finish
    reason ("stop" | "length" | "cancelled") with its stats, or the error that ended it."""
    tokens: list[int]
    finish_reason: str | None = None
    stats: Stats | None = None
    error: GenerationError | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks for them


@dataclass
class Job:
    req: Request
    on_event: Callable[[Event], None]
    created: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    seq: SeqState | None = None


@dataclass
class EngineStats:  # what /metrics reports beside the server's own counters
    cancelled: int = 0  # jobs ended early: client went away, or a stop string ended it
    cancelled_tokens: int = 0  # tokens those had been given before they were cancelled
    failed: int = 0  # jobs ended by an internal error
    step_seconds: float = 0.0  # wall time in Batch.step (drafting, the forward, sampling)
    other_seconds: float = 0.0  # wall time of the engine's own work between steps (admission, callbacks)
    proposed: int = 0  # draft tokens, finished jobs
    accepted: int = 0


class Engine:
    def __init__(self, target: Transformer, drafter: Drafter | None = None, max_batch: int = 8,
                 max_queue: int = 64, prefill_chunk: int = 0, prefix_blocks: int = 0, branches: int = 1):
        self.max_queue = max_queue
        self.queue: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self.calls: collections.deque[tuple[Callable[[], object], concurrent.futures.Future]] = collections.deque()
        self.cv = threading.Condition()
        self.stats = EngineStats()
        self.stopped = False
        ready: concurrent.futures.Future = concurrent.futures.Future()
        threads = get_num_threads()  # the caller's setting (--threads): numba's is per thread
        args = (target, drafter, max_batch, prefill_chunk, prefix_blocks, branches, threads, ready)
        self.thread = threading.Thread(target=self._run, args=args, name="exactspec-engine", daemon=True)
        self.thread.start()
        ready.result()  # the Batch (its KV cache checked to fit) or the error that stopped it

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread between two steps (a scoring pass): its Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cv:
            if not self.alive:
                raise EngineDown("the decoding engine is not running")
            self.calls.append((fn, fut))
            self.cv.notify()
        return fut

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopped

    def submit(self, job: Job) -> None:
        with self.cv:
            if not self.alive:
                raise EngineDown("the decoding engine is not running")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"request queue is full ({self.max_queue} waiting)")
            self.queue.append(job)
            self.cv.notify()

    def cancel(self, job: Job) -> None:
        with self.cv:
            job.cancelled = True
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

    # -- the engine thread ----------------------------------------------------------------------
    @staticmethod
    def _tell(job: Job, ev: Event) -> None:
        try:
            job.on_event(ev)
        except Exception:  # a caller's callback must not take the engine down
            log.exception("exactspec engine: a job's event callback raised")

    def _finish(self, job: Job, reason: str, error: Exception | None = None) -> None:
        if job in self.active:
            self.active.remove(job)
        st = job.seq.stats if job.seq is not None else None
        if st is not None:
            self.stats.proposed += st.proposed
            self.stats.accepted += st.accepted
        if reason == "cancelled":
            self.stats.cancelled += 1
            self.stats.cancelled_tokens += st.new_tokens if st is not None else 0
        err = error  # a ConstraintError names the caller's constraint: said as it is (a 400)
        if error is not None:
            self.stats.failed += 1
            if not isinstance(error, ConstraintError):  # the client gets an id; the log gets the traceback under it
                eid = uuid.uuid4().hex[:12]
                log.error("exactspec engine: error %s ended a request", eid, exc_info=error)
                err = GenerationError(f"internal error while decoding (id {eid}; the server log has the details)")
        self._tell(job, Event([], reason, st, err))

    def _admit(self) -> None:
        """Under the lock: drop cancelled jobs, move queued ones into free slots."""
        for job in [j for j in self.queue if j.cancelled]:
            self.queue.remove(job)
            self._finish(job, "cancelled")
        for job in [j for j in self.active if j.cancelled]:
            self.batch.cancel(job.seq)
            self._finish(job, "cancelled")
        while self.queue and self.batch.has_room:
            job = self.queue.popleft()
            try:
                job.seq = self.batch.add(job.req, tag=job)
            except Exception as e:
                self._finish(job, "error", e)
                continue
            self.active.append(job)
            if job.seq.finish_reason is not None:  # nothing to generate (max_new_tokens 0)
                self._finish(job, job.seq.finish_reason)

    def _run(self, target: Transformer, drafter: Drafter | None, max_batch: int, prefill_chunk: int,
             prefix_blocks: int, branches: int, threads: int, ready: concurrent.futures.Future) -> None:
        try:
            set_num_threads(threads)
            self.batch = Batch(target, max_batch, target.max_context, drafter, prefill_chunk, prefix_blocks, branches)
            self.batch.measure()  # the costs its chunking and draft lengths use: now, not in a request's step
        except BaseException as e:
            self.stopped = True
            ready.set_exception(e)
            return
        ready.set_result(None)
        try:
            self._loop()
        finally:
            with self.cv:
                self.stopped = True
            for _, fut in self._take_calls():
                fut.set_exception(EngineDown("the decoding engine stopped"))

    def _take_calls(self) -> list[tuple[Callable[[], object], concurrent.futures.Future]]:
        """The pending calls whose callers still wait (a cancelled Future is dropped)."""
        with self.cv:
            calls, self.calls = list(self.calls), collections.deque()
        return [(fn, fut) for fn, fut in calls if fut.set_running_or_notify_cancel()]

    def _calls(self) -> None:
        for fn, fut in self._take_calls():
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopped and not self.queue and not self.active and not self.calls:
                    self.cv.wait()
                if self.stopped:
                    return
            t0 = time.perf_counter()
            self._calls()
            with self.cv:
                try:
                    self._admit()
                except Exception as e:  # a bug in admission: fail what is waiting, keep serving
                    for job in list(self.queue):
                        self._finish(job, "error", e)
                    self.queue.clear()
            t1 = time.perf_counter()
            try:
                events = self.batch.step()
            except Exception as e:  # Batch.step isolates per-sequence faults; this is anything else
                with self.cv:
                    for job in list(self.active):
                        self.batch.cancel(job.seq)
                        self._finish(job, "error", e)
                continue
            t2 = time.perf_counter()
            self.stats.step_seconds += t2 - t1
            with self.cv:
                for s, new in events:
                    job: Job = s.tag
                    if new and not job.cancelled:
                        lp = s.logprobs[len(s.logprobs) - len(new):] if job.req.logprobs is not None else None
                        self._tell(job, Event(new, logprobs=lp))
                    if s.finish_reason is not None:
                        self._finish(job, s.finish_reason, s.error)
            self.stats.other_seconds += (t1 - t0) + (time.perf_counter() - t2)
