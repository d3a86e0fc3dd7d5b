"""A long prompt among short requests: how long the short ones take while it is prefilled, for
several --prefill-chunk values, against their latency alone; and whether every output is its solo one.

    python bench/long_prompt.py [--model FILE] [--long-tokens 3000] [--chunks 16 64 256 100000]

Per chunk value: starts `exactspec serve`, times SHORT requests (16 greedy tokens) alone, then sends
the long prompt (max_tokens 1) and, while it runs, the same short requests one after another.
Prints the short requests' median latency alone and beside the long prompt, the ratio, the long
prompt's own latency, and whether each short output equals its solo output. Loopback only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import default_model, serving, table  # noqa: E402

SHORT = ["def is_prime(n):", "class Stack:", "import os", "for i in range(10):", "x = [", "while True:"]


def complete(url: str, prompt, max_tokens: int) -> tuple[str, float]:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=600,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"], time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 (cached), else the toy target")
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 256, 100000])  # 100000: whole prompts
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    model = default_model(a.model)
    import exactspec
    tok = exactspec.load(model).tokenizer
    text = Path(exactspec.__file__).parent.joinpath("api.py").read_text() * 4
    long = tok.encode(text)[: a.long_tokens]
    rows = []
    for chunk in a.chunks:
        with serving("--model", model, "--threads", str(a.threads), "--prefill-chunk", str(chunk),
                     "--max-context", str(a.long_tokens + 64)) as url:
            complete(url, long[:300], 1)  # warm up: compile the shapes
            alone = {p: complete(url, p, 16) for p in SHORT}
            alone = {p: complete(url, p, 16) for p in SHORT}  # the second pass, warm
            done = {}
            th = threading.Thread(target=lambda: done.update(long=complete(url, long, 1)[1]))
            th.start()
            time.sleep(0.2)  # the long prompt is in
            beside = {}
            while th.is_alive() and len(beside) < len(SHORT):
                p = SHORT[len(beside)]
                beside[p] = complete(url, p, 16)
            th.join()
            same = all(beside[p][0] == alone[p][0] for p in beside)
            t_alone = statistics.median(t for _, t in alone.values())
            t_beside = statistics.median(t for _, t in beside.values()) if beside else float("nan")
            rows.append([chunk, f"{t_alone * 1e3:.0f} ms", f"{t_beside * 1e3:.0f} ms ({len(beside)})",
                         f"{t_beside / t_alone:.1f}x", f"{done['long']:.1f} s", "yes" if same else "NO"])
    print(f"model {Path(model).name}, long prompt {len(long)} tokens, {a.threads} threads, short: 16 greedy tokens")
    table(["--prefill-chunk", "short alone (median)", "short beside the long prompt (n)", "ratio",
           "long prompt latency", "identical"], rows)


if __name__ == "__main__":
    main()
