"""Servers for the tests: `exactspec serve` in a subprocess (`Running`), or the app on uvicorn in a
thread of the test process (`InProcess`, configured as `exactspec serve` configures it), with the
target gated so that the test, not the clock, decides when the engine steps (and which requests fail)."""
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import exactspec
from exactspec.serve.app import Server
from exactspec.serve.asgi import DrainingServer, uvicorn_config
from exactspec.serve.options import ServeOptions


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gated:
    """The target Transformer, but a forward runs only while the gate is open or with a permit
    the test hands out (`step()`): the test, not the clock, decides when the engine may step."""

    def __init__(self, net):
        self.net, self.open, self.permits = net, threading.Event(), threading.Semaphore(0)
        self.given = self.used = 0
        self.waiting = False  # a forward waits for a permit
        self.faulty: set[tuple[int, ...]] = set()  # prompts (token ids) whose sequence fails after 2 tokens
        self._marked: dict[int, int] = {}  # slot -> prompt length, while a faulty prompt decodes there

    def __getattr__(self, name):
        return getattr(self.net, name)

    def step(self) -> None:
        self.given += 1
        self.permits.release()

    @property
    def idle(self) -> bool:
        """Every permit handed out has been used (the engine waits for the next)."""
        return self.used >= self.given

    def _inject(self, tokens, slot, pos) -> None:
        """Fault injection by wrapping, as a kernel failure would look: a forward that holds a row of a
        faulty prompt's sequence past its second new token raises. (A prompt's prefill, position 0,
        marks or unmarks its slot.)"""
        t, s, p = tokens.tolist(), slot.tolist(), pos.tolist()
        for sl in {s[i] for i in range(len(t)) if p[i] == 0}:
            ids = tuple(t[i] for i in range(len(t)) if s[i] == sl)
            if ids in self.faulty:
                self._marked[sl] = len(ids)
            else:
                self._marked.pop(sl, None)
        if any(sl in self._marked and q > self._marked[sl] for sl, q in zip(s, p)):
            raise RuntimeError("fault injected by the test")

    def forward(self, tokens, slot, pos, *args, **kw):
        self._inject(tokens, slot, pos)
        deadline = time.time() + 60
        if not self.open.is_set():
            self.waiting = True
            while not self.open.is_set() and not self.permits.acquire(timeout=0.01):
                assert time.time() < deadline, "the test never let the engine step"
            self.waiting = False
            self.used += 1
        return self.net.forward(tokens, slot, pos, *args, **kw)


class InProcess:
    """The app of exactspec.server on uvicorn in a thread of this process, target gated."""

    def __init__(self, folder, opts: ServeOptions = ServeOptions(), model=None, **kw):
        self.model = model = model or exactspec.load(folder)
        self.gate = model.net = Gated(model.net)
        self.gate.open.set()  # the engine's start (it measures the model's costs) runs freely
        self.srv = Server(model, "tiny", opts=opts, **kw)
        self.gate.open.clear()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = DrainingServer(uvicorn_config(self.srv.app, "127.0.0.1", self.port, opts), self.srv.drain)
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uv.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def until(self, what, check):
        deadline = time.time() + 30
        while not check():
            if time.time() > deadline:
                pytest.fail(f"never saw {what}")
            time.sleep(0.005)

    def stop(self):
        self.gate.open.set()
        self.uv.should_exit = True
        self.thread.join(10)
        self.srv.engine.stop()


def openai_client(s, key: str = "none") -> openai.OpenAI:
    """The official client for a server `s` (generous timeout: a cold numba cache compiles for seconds)."""
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=120)


class Running:
    def __init__(self, folder, *extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "exactspec.cli", "serve", "--model", str(folder),
                                      "--port", str(self.port), "--name", "tiny", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited: " + self.proc.stdout.read())
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise RuntimeError("server did not start")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
