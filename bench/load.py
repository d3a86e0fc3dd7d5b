"""Load test of `exactspec serve`, on loopback only, bounded in requests and time.

    python bench/load.py [--model exactspec/assets/target] [--draft exactspec/assets/draft] [--clients 16 64] [--requests 3]
                         [--disconnect-every 7]

Starts the server, then for each client count N: N concurrent streaming clients send --requests
requests each (or until --seconds run out). Every --disconnect-every-th request hangs up after
its first chunk. (A request that fails inside the engine failing alone is tested by
tests/serve/test_server_hardening.py, which wraps the target: the server has no fault hook.)
Prints requests completed, disconnects, errors (must be 0), p50/p99 latency and time to first token,
aggregate tokens/s against the same requests served one at a time, and whether every completed
response equals the same request run alone.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time
from pathlib import Path

import httpx
import openai

from common import serving
from exactspec.tools.demo import demo_folder

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


def stream_raw(url: str, i: int, hang_up: bool) -> tuple[str, str | None]:
    """One streaming request over raw HTTP: ("text", None), ("", "disconnected") or (partial, error message)."""
    body = {"model": "m", "stream": True, **request(i)}
    body.update(body.pop("extra_body"))
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            return "", f"HTTP {r.status_code}: {r.read()[:200]!r}"
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return "".join(text), ev["error"]["message"]
            text.append(ev["choices"][0]["text"] if ev["choices"] else "")
            if hang_up:
                return "", "disconnected"
    return "".join(text), None


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(demo_folder() / "target"))
    ap.add_argument("--draft", default=str(demo_folder() / "draft"))
    ap.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--requests", type=int, default=3, help="requests per client and round")
    ap.add_argument("--seconds", type=float, default=120, help="a round stops sending after this")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--disconnect-every", type=int, default=7, help="every n-th request hangs up (0: none)")
    a = ap.parse_args()
    args = ["--model", a.model, "--max-batch", str(a.max_batch), "--max-queue", "256", "--dtype", "bfloat16"]
    if a.draft:
        args += ["--draft", a.draft, "--num-draft-tokens", "4"]
    with serving(*args) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        stream_one(client, 0)  # warm up: the first requests compile kernels for their shapes
        stream_raw(url, 1, False)
        # reference: each distinct request alone, one at a time
        alone, t0, toks = {}, time.perf_counter(), 0
        for i in range(2 * len(PROMPTS)):
            text, _, _, n = stream_one(client, i)
            alone[i % (2 * len(PROMPTS))] = text
            toks += n
        serial_tps = toks / (time.perf_counter() - t0)
        print(f"server: {Path(a.model).name}{' + draft ' + Path(a.draft).name if a.draft else ''}, "
              f"max batch {a.max_batch}; one request at a time: {serial_tps:.1f} tok/s")
        print(f"{'clients':>7} {'done':>5} {'hung up':>7} {'errors':>6} {'lat p50':>8} {'lat p99':>8} "
              f"{'ttft p50':>8} {'ttft p99':>8} {'tok/s':>7} {'vs serial':>9}  identical to solo")
        for n_clients in a.clients:
            deadline = time.perf_counter() + a.seconds
            results, hung, errors = [], [0], []

            def worker(w: int) -> None:
                for r in range(a.requests):
                    j = w + r * n_clients
                    if time.perf_counter() > deadline:
                        return
                    hang = bool(a.disconnect_every) and j % a.disconnect_every == a.disconnect_every - 1
                    try:
                        if hang:
                            _, err = stream_raw(url, j, hang)
                            if err == "disconnected":
                                hung[0] += 1
                            else:
                                errors.append(err or "the hang-up was not seen")
                            continue
                        t = time.perf_counter()
                        text, ttft, gaps, n = stream_one(client, j)
                        results.append((j, text, ttft, time.perf_counter() - t, n))
                    except Exception as e:
                        errors.append(f"{type(e).__name__}: {e}")
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(n_clients) as ex:
                list(ex.map(worker, range(n_clients)))
            dt = time.perf_counter() - t0
            ttfts = [r[2] for r in results]
            lats = [r[3] for r in results]
            tps = sum(r[4] for r in results) / dt
            same = all(r[1] == alone[r[0] % (2 * len(PROMPTS))] for r in results)
            print(f"{n_clients:7d} {len(results):5d} {hung[0]:7d} {len(errors):6d} "
                  f"{pct(lats, .5):7.2f}s {pct(lats, .99):7.2f}s {pct(ttfts, .5) * 1e3:6.0f}ms "
                  f"{pct(ttfts, .99) * 1e3:6.0f}ms {tps:7.1f} {tps / serial_tps:8.2f}x  {'yes' if same else 'NO'}")
            for e in errors[:5]:
                print("   unexpected error:", e)
        health = httpx.get(url + "/health", timeout=10).json()
        print(f"after the rounds: /health {health}")


if __name__ == "__main__":
    main()
