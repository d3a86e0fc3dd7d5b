"""`exactspec demo`: the shipped target/draft pair completes Python prompts; plain greedy vs
draft model vs prompt lookup, with tokens/s, acceptance and an on-the-spot identity check."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from .errors import CheckpointError

PROMPTS = [
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    'class LRUCache:\n    """A least-recently-used cache with a fixed capacity."""\n\n    def __init__(self, capacity):\n',
    'def read_lines(path):\n    """Return the lines of the file at path, without newlines."""\n',
]


def demo_folder() -> Path:
    return Path(__file__).resolve().parents[1] / "demo"


def run(folder: Path | None = None, max_new_tokens: int = 128, k: int | str = "dynamic", dtype: str = "bfloat16",
        repetition_penalty: float = 1.2, out=sys.stdout) -> list[dict]:
    from . import load
    folder = folder or demo_folder()
    if not (folder / "target").is_dir() or not (folder / "draft").is_dir():
        raise CheckpointError(f"{folder}: the demo pair (target/, draft/) is missing; "
                              f"train it with `python train/demo_pair.py --out {folder}`")
    target = load(folder / "target", dtype=dtype)
    draft = load(folder / "draft", dtype=dtype)
    target.generate(PROMPTS[0], 8, draft=draft)  # compile kernels / warm caches before timing
    methods = [("plain greedy", None), ("draft model", draft), ("prompt lookup", "lookup")]
    totals = {name: [0, 0.0, 0, 0, True] for name, _ in methods}  # tokens, seconds, proposed, accepted, same
    for p in PROMPTS:
        out.write("\n" + "-" * 72 + "\n" + p)
        plain = None
        for name, d in methods:
            on_text = (lambda s: (out.write(s), out.flush())) if d is None else None
            t = time.perf_counter()
            r = target.generate(p, max_new_tokens, draft=d, num_draft_tokens=k if d is not None else 0,
                                repetition_penalty=repetition_penalty, on_text=on_text)
            dt = time.perf_counter() - t
            plain = plain or r.token_ids
            tot = totals[name]
            tot[0] += len(r.token_ids)
            tot[1] += dt
            tot[2] += r.stats.proposed
            tot[3] += r.stats.accepted
            tot[4] &= r.token_ids == plain
        out.write("\n")
    base = totals["plain greedy"][0] / totals["plain greedy"][1]
    rows = []
    out.write("\n" + "=" * 72 + f"\n{'method':<15} {'tok/s':>8} {'speedup':>8} {'acceptance':>11}  identical to plain greedy\n")
    for name, (n, s, prop, acc, same) in totals.items():
        tps = n / s
        rate = acc / prop if prop else float("nan")
        rows.append(dict(method=name, tokens_per_second=tps, speedup=tps / base, acceptance_rate=rate, identical=same))
        acc_s = f"{rate:11.1%}" if prop else f"{'-':>11}"
        out.write(f"{name:<15} {tps:8.1f} {tps / base:7.2f}x {acc_s}  {'yes' if same else 'NO'}\n")
    out.write(f"(greedy with repetition_penalty={repetition_penalty}, k={k}, {dtype} weights, {len(PROMPTS)} prompts "
              f"x up to {max_new_tokens} new tokens)\n")
    return rows
