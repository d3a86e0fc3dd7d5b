"""Load test of `exactspec serve`, on loopback only, bounded in requests and time.

    python bench/load.py [--model demo/target] [--draft demo/draft] [--clients 16 64] [--seconds 60]

Starts the server, then for each client count N: N concurrent streaming clients send requests
until the time is up. Prints requests completed, errors (must be 0), p50/p99 time to first token
and per-token latency, aggregate tokens/s against the same requests served one at a time, and
checks that every response equals the same request run alone.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from exactspec.demo import demo_folder

PROMPTS = ["def is_prime(n):\n", "class Stack:\n    def __init__(self):\n", "import os\nimport sys\n\n",
           "def read_lines(path):\n    \"\"\"Return the lines of a file.\"\"\"\n", "for i in range(10):\n",
           "try:\n    import json\nexcept ImportError:\n", "def main(argv=None):\n", "if __name__ == '__main__':\n"]


def request(i: int) -> dict:
    return dict(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=64, temperature=0.0 if i % 2 else 0.8,
                seed=i % (2 * len(PROMPTS)), extra_body={"ignore_eos": True})


def stream_one(client: openai.OpenAI, i: int) -> tuple[str, float, list[float], int]:
    t0 = time.perf_counter()
    ttft, stamps, text, n = None, [], [], 0
    for c in client.completions.create(model="m", stream=True, stream_options={"include_usage": True}, **request(i)):
        now = time.perf_counter()
        if c.choices and c.choices[0].text:
            if ttft is None:
                ttft = now - t0
            stamps.append(now)
            text.append(c.choices[0].text)
        if c.usage is not None:
            n = c.usage.completion_tokens
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return "".join(text), ttft or 0.0, gaps, n


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(demo_folder() / "target"))
    ap.add_argument("--draft", default=str(demo_folder() / "draft"))
    ap.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seconds", type=float, default=45)
    ap.add_argument("--max-batch", type=int, default=16)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "exactspec.cli", "serve", "--model", a.model, "--name", "m", "--port", str(port),
           "--max-batch", str(a.max_batch), "--max-queue", "256", "--dtype", "bfloat16"]
    if a.draft:
        cmd += ["--draft", a.draft, "--num-draft-tokens", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        # reference: each distinct request alone, one at a time
        alone, t0, toks = {}, time.perf_counter(), 0
        for i in range(2 * len(PROMPTS)):
            text, _, _, n = stream_one(client, i)
            alone[i % (2 * len(PROMPTS))] = text
            toks += n
        serial_tps = toks / (time.perf_counter() - t0)
        print(f"server: {Path(a.model).name}{' + draft ' + Path(a.draft).name if a.draft else ''}, "
              f"max batch {a.max_batch}; one request at a time: {serial_tps:.1f} tok/s")
        print(f"{'clients':>7} {'done':>5} {'errors':>6} {'ttft p50':>9} {'ttft p99':>9} {'tok p50':>8} "
              f"{'tok p99':>8} {'tok/s':>7} {'vs serial':>9} identical")
        for n_clients in a.clients:
            deadline = time.perf_counter() + a.seconds
            results, errors = [], 0

            def worker(w: int) -> None:
                nonlocal errors
                j = w
                while time.perf_counter() < deadline:
                    try:
                        results.append((j, *stream_one(client, j)))
                    except Exception:
                        errors += 1
                    j += n_clients
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(n_clients) as ex:
                list(ex.map(worker, range(n_clients)))
            dt = time.perf_counter() - t0
            ttfts = [r[2] for r in results]
            gaps = [g for r in results for g in r[3]]
            tps = sum(r[4] for r in results) / dt
            same = all(r[1] == alone[r[0] % (2 * len(PROMPTS))] for r in results)
            print(f"{n_clients:7d} {len(results):5d} {errors:6d} {pct(ttfts, .5) * 1e3:8.0f}ms {pct(ttfts, .99) * 1e3:8.0f}ms "
                  f"{pct(gaps, .5) * 1e3:7.1f}ms {pct(gaps, .99) * 1e3:7.1f}ms {tps:7.1f} {tps / serial_tps:8.2f}x "
                  f"{'yes' if same else 'NO'}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
