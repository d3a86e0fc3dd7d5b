"""A repeated long system prompt through `exactspec serve`, prefix cache on vs off, and the server's
resident memory.

    python bench/prefix_cache.py [--model FILE] [--system-tokens 500] [--questions 6]

For each setting: a fresh server (--max-batch 8, the default context), one warm-up request with the
system prompt, then --questions requests `system + question` one at a time (greedy, 32 tokens,
streaming): time to first token (median), whether every text equals the cache-off one, the
cached tokens reported in usage, and the server's resident memory (VmRSS) after the run."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from common import default_model, serving, table

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly.",
             "List three prime numbers.", "What does HTTP stand for?", "Give me a synonym for happy.",
             "How many legs has a spider?", "Name a famous painter."]


def rss_of_port(port: int) -> float:
    """MB resident of the process serving on `port` (found by its command line)."""
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"serve" in cmd and str(port).encode() in cmd:
            for line in (p / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    return float("nan")


def run(model: str, system: str, questions: list[str], mb: int) -> dict:
    with serving("--model", model, "--prefix-cache-mb", str(mb)) as url, httpx.Client(base_url=url, timeout=600) as c:
        c.post("/v1/completions", json=dict(prompt=system + "Hello.", max_tokens=2, temperature=0)).raise_for_status()
        ttft, texts, cached = [], [], []
        for q in questions:
            t0, first, text = time.perf_counter(), None, []
            body = dict(prompt=system + q, max_tokens=32, temperature=0, stream=True, ignore_eos=True,
                        stream_options={"include_usage": True})
            with c.stream("POST", "/v1/completions", json=body) as s:
                for line in s.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("choices") and first is None:  # the first token's chunk
                        first = time.perf_counter() - t0
                    text += [ch["text"] for ch in ev.get("choices") or []]
                    if ev.get("usage"):
                        cached.append(ev["usage"]["prompt_tokens_details"]["cached_tokens"])
            ttft.append(first)
            texts.append("".join(text))
        rss = rss_of_port(int(url.rsplit(":", 1)[1]))
        return dict(ttft=statistics.median(ttft), texts=texts, cached=cached, rss=rss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--questions", type=int, default=6)
    a = ap.parse_args()
    model = default_model(a.model)
    import exactspec
    tok = exactspec.load(model).tokenizer
    unit = "You are a helpful assistant for a hardware store. Be brief, be kind, and never invent prices. "
    system = unit * (a.system_tokens // len(tok.encode(unit, add_special_tokens=False)) + 1)
    n_sys = len(tok.encode(system, add_special_tokens=False))
    qs = QUESTIONS[: a.questions]
    off, on = run(model, system, qs, 0), run(model, system, qs, 256)
    table(("prefix cache", "TTFT median (s)", "cached tokens (median)", "texts equal cache off", "server RSS (MB)"),
          [("off", f"{off['ttft']:.3f}", statistics.median(off["cached"]), "-", f"{off['rss']:.0f}"),
           ("on", f"{on['ttft']:.3f}", statistics.median(on["cached"]), on["texts"] == off["texts"],
            f"{on['rss']:.0f}")],
          f"{model}: a {n_sys}-token system prompt + {len(qs)} questions, one at a time; TTFT off/on = "
          f"{off['ttft'] / on['ttft']:.1f}x")


if __name__ == "__main__":
    main()
