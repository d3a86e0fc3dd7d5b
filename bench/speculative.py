"""Plain greedy vs draft-model vs prompt-lookup decoding, same model and prompts, one run.

    python bench/speculative.py                      # random models built here (needs transformers)
    python bench/speculative.py --target DIR --draft DIR [--dtype bfloat16]

Prints tokens/s of each method, its ratio to plain greedy, acceptance rate, mean tokens per
target forward, and whether the token ids equal plain greedy's (they must: "identical: yes").
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import exactspec

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\nfor path in sys.argv[1:]:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]


def random_pair(folder: Path) -> tuple[Path, Path]:
    from exactspec.tools.testing import make_checkpoint
    t = make_checkpoint(folder / "target", "llama", seed=0, near_ties=False, layers=8, hidden=512,
                        num_attention_heads=8, num_key_value_heads=4)
    d = make_checkpoint(folder / "draft", "llama", seed=1, near_ties=False, layers=1, hidden=128)
    return t, d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", default="4", help="draft tokens per step, or 'dynamic'")
    a = ap.parse_args()
    k = a.k if a.k == "dynamic" else int(a.k)
    tmp = None
    if a.target is None:
        tmp = tempfile.TemporaryDirectory()
        tdir, ddir = random_pair(Path(tmp.name))
        print("random models: target llama 8x512 (vocab 320), draft llama 1x128; no training, so the "
              "draft's guesses are unrelated to the target's")
    else:
        tdir, ddir = Path(a.target), Path(a.draft) if a.draft else None
    target = exactspec.load(tdir, dtype=a.dtype)
    draft = exactspec.load(ddir, dtype=a.dtype) if ddir else None
    target.generate(PROMPTS[0], 4)  # compile / warm up
    methods = [("plain greedy", None), ("prompt lookup", "lookup")]
    if draft is not None:
        methods.insert(1, ("draft model", draft))
    rows, base = [], None
    for name, d in methods:
        toks, secs, prop, acc, steps, ids = 0, 0.0, 0, 0, 0, []
        for p in PROMPTS:
            t = time.perf_counter()
            r = target.generate(p, a.max_new_tokens, ignore_eos=True, draft=d, num_draft_tokens=k if d else 0)
            secs += time.perf_counter() - t
            toks += len(r.token_ids)
            prop, acc, steps = prop + r.stats.proposed, acc + r.stats.accepted, steps + r.stats.forward_passes
            ids.append(r.token_ids)
        tps = toks / secs
        if base is None:
            base = (tps, ids)
        rows.append((name, tps, tps / base[0], acc / prop if prop else 0.0, toks / steps, ids == base[1]))
    print(f"\n{'method':<15} {'tok/s':>8} {'vs plain':>9} {'accept':>7} {'tok/fwd':>8} identical")
    for name, tps, ratio, rate, per, same in rows:
        print(f"{name:<15} {tps:8.1f} {ratio:8.2f}x {rate:7.1%} {per:8.2f} {'yes' if same else 'NO'}")
    if not all(r[-1] for r in rows):
        sys.exit("speculative output differs from plain greedy")


if __name__ == "__main__":
    main()
