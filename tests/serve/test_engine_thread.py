"""The server's numeric work runs on one thread. OpenMP (libgomp, shared by numba and torch) gives
every thread that starts a parallel region its own pool of workers; once the pools hold more threads
than the machine has cores, workers sleep at every barrier instead of spinning and each kernel pays a
wake-up: the server whose main thread had zeroed the KV cache (and whose scoring passes ran in worker
threads) decoded at half the library's speed on 2 cores."""
import threading

import httpx
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
