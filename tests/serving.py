"""Servers for the tests: the app of exactspec.server on uvicorn in a thread of the test process
(configured as `exactspec serve` configures it), with the target gated so that the test, not the
clock, decides when the engine steps."""
import socket
import threading
import time

import pytest
import uvicorn

import exactspec
from exactspec.serve.app import ServeOptions, Server, uvicorn_config


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

    def __getattr__(self, name):
        return getattr(self.net, name)

    def step(self) -> None:
        self.given += 1
        self.permits.release()

    @property
    def idle(self) -> bool:
        """Every permit handed out has been used (the engine waits for the next)."""
        return self.used >= self.given

    def forward(self, *args, **kw):
        deadline = time.time() + 60
        if not self.open.is_set():
            while not self.open.is_set() and not self.permits.acquire(timeout=0.01):
                assert time.time() < deadline, "the test never let the engine step"
            self.used += 1
        return self.net.forward(*args, **kw)


class InProcess:
    """The app of exactspec.server on uvicorn in a thread of this process, target gated."""

    def __init__(self, folder, opts: ServeOptions = ServeOptions(), model=None, **kw):
        self.model = model = model or exactspec.load(folder)
        self.gate = model.net = Gated(model.net)
        self.srv = Server(model, "tiny", opts=opts, **kw)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn_config(self.srv.app, "127.0.0.1", self.port, opts))
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
