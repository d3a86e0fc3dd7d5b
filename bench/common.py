"""What the benches share: the Qwen2.5-0.5B shape, the machine's read bandwidth, a timer, a
markdown table. Benches run as scripts (`python bench/x.py`), so this is imported as `common`
(also by a Python that has llama-cpp-python but no torch)."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from typing import Callable, Iterator, Sequence

# Qwen2.5-0.5B's shape (random weights are made from it; 896 hidden, 24 layers, 14/2 heads)
QWEN_05B = dict(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)


def timed(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def read_bandwidth() -> float:
    """Bytes/s of torch.sum over 1 GiB of float32 (best of 5): the memory-bandwidth limit's base."""
    import torch  # here: compare_llamacpp's llama.cpp side imports this module without torch
    x = torch.ones(256 * 1024 * 1024)
    x.sum()
    return x.numel() * 4 / min(timed(x.sum) for _ in range(5))


def table(header: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> None:
    """Print a markdown table (one row a line, cells as str())."""
    if title:
        print(f"\n### {title}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


@contextlib.contextmanager
def http_server(argv: Callable[[int], list[str]], env: dict | None = None) -> Iterator[str]:
    """The server `argv(port)` starts, on a free loopback port, until the block ends: yields its URL
    once /health answers (200)."""
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(argv(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def serving(*args: str, env: dict | None = None) -> contextlib.AbstractContextManager[str]:
    """`exactspec serve --name m ARGS` (see http_server)."""
    return http_server(lambda port: [sys.executable, "-m", "exactspec.cli", "serve", "--name", "m", "--port",
                                     str(port), *args], env)


def default_model(arg: str | None = None) -> str:
    """`arg`, else the demo's SmolLM2-135M-Instruct Q4_1 file (cached, or fetched once), else the toy target."""
    if arg:
        return arg
    from exactspec.tools import fetch
    try:
        return str(fetch.smollm2(quiet=True))
    except fetch.FetchError:
        from exactspec.tools.demo import demo_folder
        return str(demo_folder() / "target")
