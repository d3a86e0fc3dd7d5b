"""One client against `exactspec serve` vs the library's `generate`, same model, same threads.

    python bench/serve_speed.py [--model FILE] [--threads 1 2] [--tokens 200] [--repeat 3]

For each thread count: `Model.generate` in a fresh process (greedy, --tokens tokens, ignore_eos),
then `exactspec serve --threads N` with the same request non-streaming and streaming (the client's
own time included, as a user sees it). Prints tokens/s medians and the server/library ratio
(issue 25's target: >= 0.95, and 2 threads never slower than 1)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import httpx

from common import default_model, serving, table

PROMPT = "Write a story about a robot who learns to paint."

LIB = """
import json, statistics, sys, time
import exactspec
exactspec.set_num_threads({threads})
m = exactspec.load({model!r})
m.generate({prompt!r}, max_new_tokens=8)
r = []
for _ in range({repeat}):
    t = time.perf_counter()
    m.generate({prompt!r}, max_new_tokens={tokens}, ignore_eos=True)
    r.append({tokens} / (time.perf_counter() - t))
print(json.dumps(statistics.median(r)))
"""


def library(model: str, threads: int, tokens: int, repeat: int) -> float:
    code = LIB.format(threads=threads, model=model, prompt=PROMPT, tokens=tokens, repeat=repeat)
    return json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1])


def server(model: str, threads: int, tokens: int, repeat: int) -> tuple[float, float]:
    body = dict(model="m", prompt=PROMPT, max_tokens=tokens, temperature=0, ignore_eos=True)
    with serving("--model", model, "--threads", str(threads)) as url, httpx.Client(base_url=url, timeout=600) as c:
        c.post("/v1/completions", json=dict(body, max_tokens=8)).raise_for_status()
        whole, stream = [], []
        for _ in range(repeat):
            t = time.perf_counter()
            n = c.post("/v1/completions", json=body).json()["usage"]["completion_tokens"]
            whole.append(n / (time.perf_counter() - t))
        for _ in range(repeat):
            t, n = time.perf_counter(), 0
            with c.stream("POST", "/v1/completions", json=dict(body, stream=True)) as s:
                for line in s.iter_lines():
                    n += line.startswith("data: {")
            stream.append(n / (time.perf_counter() - t))
    return statistics.median(whole), statistics.median(stream)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the demo's SmolLM2 Q4_1 file, else the toy target")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    model = default_model(a.model)
    rows = []
    for t in a.threads:
        lib = library(model, t, a.tokens, a.repeat)
        whole, stream = server(model, t, a.tokens, a.repeat)
        rows.append((t, f"{lib:.1f}", f"{whole:.1f}", f"{stream:.1f}", f"{whole / lib:.2f}", f"{stream / lib:.2f}"))
    table(("threads", "generate tok/s", "serve tok/s", "serve stream tok/s", "serve / generate",
           "stream / generate"), rows, f"{model}, {a.tokens} greedy tokens, medians of {a.repeat}")


if __name__ == "__main__":
    main()
