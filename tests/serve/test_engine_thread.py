"""The server's numeric work runs on one thread. OpenMP (libgomp, shared by numba and torch) gives
every thread that starts a parallel region its own pool of workers; once the pools hold more threads
than the machine has cores, workers sleep at every barrier instead of spinning and each kernel pays a
wake-up: the server whose main thread had zeroed the KV cache (and whose scoring passes ran in worker
threads) decoded at half the library's speed on 2 cores."""
import threading

import httpx
import pytest
import numba

import exactspec
from tests.serve.serving import InProcess


class Spy:
    """The target, recording the name of each thread that allocates a cache or runs a forward."""

    def __init__(self, net):
        self.net, self.threads = net, set()

    def __getattr__(self, name):
        return getattr(self.net, name)

    def new_cache(self, *a, **kw):
        self.threads.add(("new_cache", threading.current_thread().name))
        return self.net.new_cache(*a, **kw)

    def forward(self, *a, **kw):
        self.threads.add(("forward", threading.current_thread().name, numba.get_num_threads()))
        return self.net.forward(*a, **kw)


def test_cache_steps_and_scoring_all_on_the_engine_thread(folder):
    """... with the thread count the server was given (numba's setting is per thread: the engine
    thread ran 2 threads under `--threads 1`)."""
    exactspec.set_num_threads(1)
    model = exactspec.load(folder)
    ids = model.encode("def add(a, b):")
    want = [x.logprob for x in model.score(ids[:1], ids[1:])]
    spy = model.net = Spy(model.net)
    s = InProcess(folder, model=model)
    s.gate.open.set()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            gen = c.post("/v1/completions", json=dict(prompt=ids, max_tokens=4, temperature=0))
            scored = c.post("/v1/completions", json=dict(prompt=ids, max_tokens=0, echo=True, logprobs=1))
            both = c.post("/v1/completions", json=dict(prompt=ids, max_tokens=2, echo=True, logprobs=0))
        assert [r.status_code for r in (gen, scored, both)] == [200, 200, 200]
        assert scored.json()["choices"][0]["logprobs"]["token_logprobs"][1:] == want
    finally:
        s.stop()
        exactspec.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert spy.threads == {("new_cache", "exactspec-engine"), ("forward", "exactspec-engine", 1)}


def test_loading_a_model_or_head_starts_no_thread_pool(tmp_path):
    """A server loads its target and drafter on the main thread; a parallel torch op there (a bf16
    conversion of a large tensor) would give that thread an OpenMP pool of its own: a draft model or
    head then ran at half speed in the server (0.50x of greedy where the library gave 0.87-0.94x)."""
    import subprocess
    import sys
    from exactspec.tools.testing import make_checkpoint
    folder = make_checkpoint(tmp_path / "m", "llama", hidden=256, layers=1)  # tensors above torch's grain size
    code = ("import os, torch, exactspec\n"
            "exactspec.kernels.rope_table(torch.ones(2), 2)\n"  # numba's first call starts a helper thread of its own
            "n = len(os.listdir('/proc/self/task'))\n"
            f"m = exactspec.load({str(folder)!r}, dtype='bfloat16')\n"
            "print(n, len(os.listdir('/proc/self/task')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    assert after == before, (before, after)



def test_the_server_loads_with_serial_kernels(folder, monkeypatch):
    """`exactspec serve` loads under kernels.threads.main_thread_serial: the load's parallel kernels (the RoPE
    tables, packing) ran on the main thread with 2 threads and gave it an OpenMP pool beside the engine
    thread's; with more pool threads than cores every kernel launch paid a futex wake-up, and `exactspec serve`
    decoded 77 tok/s where the library gave 260 (2 cores, 2026-12-08; 228 with the guard). The drafter too (a
    head's weights are packed as it loads)."""
    import torch
    from exactspec import cli
    from exactspec.api import Model

    seen, real = [], exactspec.load

    class Loaded(Exception):
        pass

    def load(*a, **kw):
        seen.append(("load", numba.get_num_threads(), torch.get_num_threads()))
        return real(*a, **kw)

    def make_drafter(self, *a, **kw):  # where a head's weights are loaded and packed
        seen.append(("drafter", numba.get_num_threads(), torch.get_num_threads()))
        raise Loaded
    monkeypatch.setattr(exactspec, "load", load)
    monkeypatch.setattr(Model, "make_drafter", make_drafter)
    try:
        with pytest.raises(Loaded):
            cli.main(["serve", "--model", str(folder), "--threads", "2", "--port", "0", "--draft", "lookup"])
        assert seen == [("load", 1, 1), ("drafter", 1, 1)]
        assert numba.get_num_threads() == 2  # and the setting is back for the engine thread to take over
    finally:
        exactspec.set_num_threads(numba.config.NUMBA_NUM_THREADS)
