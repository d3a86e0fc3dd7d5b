"""Threads: the pool's size, and each parallel kernel's serial twin for calls too small to wake it.
Threads only ever split outputs (weight blocks, rows, (row, head) pairs), so neither changes a bit."""
from __future__ import annotations

import contextlib
import types
from typing import Iterator

import numba
import torch
from numba import njit

from ..errors import InvalidRequest

SERIAL_WORK = 1 << 18  # multiply-adds below which a call runs on the calling thread (~30 us)


def set_num_threads(n: int) -> None:
    """Threads for our kernels and for torch's (elementwise) ops. Results do not depend on it."""
    most = numba.config.NUMBA_NUM_THREADS
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise InvalidRequest(f"threads={n!r}: must be an integer from 1 to {most} (numba's thread pool; "
                             "NUMBA_NUM_THREADS raises it)", "threads")
    numba.set_num_threads(n)
    torch.set_num_threads(n)


def get_num_threads() -> int:
    """The calling thread's setting: numba's is per thread (a new thread starts from NUMBA_NUM_THREADS),
    so a thread that runs kernels for another must take it over (serve.engine does)."""
    return numba.get_num_threads()


@contextlib.contextmanager
def torch_serial() -> Iterator[None]:
    """torch's ops on one thread inside the block. For work done once on a thread that will not run the
    kernels (loading a model on a server's main thread): a parallel torch op there would give that
    thread an OpenMP worker pool of its own, and with more pool threads than cores every parallel
    kernel of the engine thread pays futex wake-ups (docs/exactness.md, "Threads on two cores")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@contextlib.contextmanager
def main_thread_serial() -> Iterator[None]:
    """numba's and torch's kernels on one thread inside the block: for a server's main thread, which loads the
    model and then leaves every kernel to the engine thread. A parallel kernel run here (packing weights, the
    RoPE tables) would give this thread an OpenMP pool of its own; with more pool threads than cores libgomp's
    workers stop spinning and every parallel launch of the engine pays a futex wake-up (measured 2026-12-08 on
    2 cores: `exactspec serve` 77 tok/s where the library gives 260)."""
    n = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with torch_serial():
            yield
    finally:
        numba.set_num_threads(n)


class TwoBuilds:
    """A parallel kernel and the same source compiled without threads, for calls too small to pay
    a thread-pool wake-up: `run(work, limit, *args)` takes the serial build below `limit`
    multiply-adds. Without fastmath the compiler must keep every rounding as written, so the two
    builds give the same bits (tests compare rows across the switch).

    The serial copy gets its own name: numba's disk cache keys entries by function name, line and
    signature, not by the `parallel` flag, so a same-named serial build would load the cached
    parallel machine code (or the reverse). `calls`: parallel kernels the source calls by name (other
    TwoBuilds), whose serial builds the serial copy calls instead."""

    def __init__(self, parallel_kernel, calls: dict[str, "TwoBuilds"] | None = None):
        f = parallel_kernel.py_func
        names = dict(f.__globals__, **{k: v.serial for k, v in calls.items()}) if calls else f.__globals__
        g = types.FunctionType(f.__code__, names, f.__name__ + "_serial", f.__defaults__, f.__closure__)
        g.__qualname__ = f.__qualname__ + "_serial"
        self.parallel, self.serial = parallel_kernel, njit(cache=True, nogil=True)(g)

    def run(self, work: int, limit: int, *args):
        return (self.serial if work < limit else self.parallel)(*args)
