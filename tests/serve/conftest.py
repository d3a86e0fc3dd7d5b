"""What the server tests share: the served checkpoint (a tiny Qwen2), the model loaded in this
process (for solo runs to compare with), and servers in this process (`serve(opts, gate=...)`)."""
import pytest

import exactspec
from exactspec.serve.options import ServeOptions
from tests.serve.serving import InProcess


@pytest.fixture(scope="module")
def folder(ckpt):
    return ckpt("qwen2")


@pytest.fixture(scope="module")
def model(folder):
    return exactspec.load(folder)


@pytest.fixture
def serve(folder):
    """serve(opts, gate="open" | "closed", **Server kwargs) -> a started InProcess server, stopped after the test."""
    made = []

    def start(opts=ServeOptions(), gate="open", **kw):
        s = InProcess(folder, opts, **kw)
        if gate == "open":  # the engine steps freely; "closed": only when the test opens the gate
            s.gate.open.set()
        made.append(s)
        return s
    yield start
    for s in made:
        s.stop()

