"""`exactspec demo`'s drafters against plain greedy, paired: each round runs every method back to back on each
of the demo's chats, and a method's speedup is its tokens/s over plain greedy's in the same round; the median
over rounds is printed (this 2-core VM's speed drifts by 20% within minutes; pairing cancels most of it).

    python bench/demo_drafters.py [--rounds 5] [--max-new-tokens 160]
    NUMBA_CPU_NAME=haswell python bench/demo_drafters.py      # the AVX2 level on any x86 machine

The demo's SmolLM2-135M-Instruct Q4_1 file (fetched once), k="auto" for every drafter: the shipped head,
head + prompt lookup, prompt lookup, the distilled draft model.
"""
from __future__ import annotations

import argparse
import statistics
import time

from exactspec import load
from exactspec.kernels import cpu
from exactspec.text import chat
from exactspec.tools import fetch
from exactspec.tools.demo import CHAT_PROMPTS, demo_folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    a = ap.parse_args()
    d = cpu.describe()
    print(f"{d['cpu']}, numba target {d['numba_target']}; integer dots: {d['integer_dot']}", flush=True)
    target = load(fetch.smollm2(), max_context=1024)
    methods = [("plain", None), ("head+lookup", "head+lookup"), ("head", "head"), ("lookup", "lookup"),
               ("draft model", load(demo_folder() / "smollm2-draft", dtype="bfloat16", max_context=1024))]
    prompts = [chat.render(target.tokenizer.config, [{"role": "user", "content": m}]) for _, m in CHAT_PROMPTS]
    for _, dr in methods:  # compile and calibrate before timing
        target.generate(prompts[0], 12, draft=dr, num_draft_tokens="auto" if dr is not None else 0)
    ratios: dict[str, list[float]] = {n: [] for n, _ in methods[1:]}
    for r in range(a.rounds):
        tot = {n: [0, 0.0] for n, _ in methods}
        plain = {}
        for i, p in enumerate(prompts):
            for n, dr in methods:
                t = time.perf_counter()
                res = target.generate(p, a.max_new_tokens, draft=dr, num_draft_tokens="auto" if dr is not None else 0)
                tot[n][1] += time.perf_counter() - t
                tot[n][0] += len(res.token_ids)
                if plain.setdefault(i, res.token_ids) != res.token_ids:
                    raise SystemExit(f"{n}: tokens differ from plain greedy on chat {i}")
        base = tot["plain"][0] / tot["plain"][1]
        for n in ratios:
            ratios[n].append(tot[n][0] / tot[n][1] / base)
        print(f"round {r}: plain {base:.1f} tok/s; " + ", ".join(f"{n} {ratios[n][-1]:.3f}x" for n in ratios), flush=True)
    print("median over rounds: " + ", ".join(f"{n} {statistics.median(v):.3f}x" for n, v in ratios.items()))


if __name__ == "__main__":
    main()
