"""The shipped drafting head for SmolLM2-135M-Instruct (exactspec/assets/smollm2-head), built offline
on 2 cores from the Q4_1 file the demo runs (`exactspec distill --head` does the same for any model):

    python scripts/smollm2_head.py --out exactspec/assets/smollm2-head [--record-minutes 12] [--train-minutes 20]

Prompts: general chat questions plus ones made from the Python standard library (a module's purpose,
a function to write from its docstring, a function's source to edit, explain or translate).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import exactspec
from exactspec.tools import fetch
from exactspec.tools import head_train as HT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--record-minutes", type=float, default=12.0)
    ap.add_argument("--train-minutes", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--data", default="/tmp/smollm2_head_states.npz", help="cache of the recorded transcripts")
    ap.add_argument("--extra-data", nargs="*", default=[], help="other runs' --data caches, trained on too")
    ap.add_argument("--init", default=None, help="a head folder to train further")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0, help="which shuffle of the standard library's prompts")
    a = ap.parse_args()
    model = exactspec.load(fetch.smollm2(), max_context=1024)
    prompts = HT.GENERAL + HT.stdlib_prompts(6000, seed=a.seed)
    if a.seed:  # more data for a head trained on seed 0's: none of the prompts that run could have reached
        seen = set(HT.GENERAL + HT.stdlib_prompts(6000)[:1500])
        prompts = [p for p in prompts if p not in seen]
    meta = HT.distill_head(model, Path(a.out), prompts, a.record_minutes, a.train_minutes, a.draft_vocab,
                           a.max_new_tokens, a.batch, Path(a.data), name="SmolLM2-135M-Instruct (Q4_1 GGUF)",
                           init=Path(a.init) if a.init else None, lr=a.lr,
                           extra_data=[Path(p) for p in a.extra_data])
    print(json.dumps({k: v for k, v in meta.items() if k != "target"}, indent=1))


if __name__ == "__main__":
    main()
