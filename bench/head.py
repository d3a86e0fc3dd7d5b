"""Drafters on SmolLM2-135M-Instruct chats, one run side by side: plain greedy, the shipped hidden-state
head, the head beside prompt lookup, the head with tree verification (up to 2 runners-up of its first
token verified beside the draft where the measured costs say so), prompt lookup, the distilled draft
model; each with the same "auto" draft length.

    python bench/head.py [--dtype auto bfloat16] [--max-new-tokens 160] [--head PATH]

A mix of chats (the demo's three plus general chat, code writing, code editing and extraction from a
given text). Prints per method and dtype: tokens/s end to end, the ratio to plain greedy, acceptance,
acceptance by draft position (the share of steps that proposed a token there and had it accepted),
tokens per verify step, and whether every answer equals plain greedy's (it must). For the head also
its measured cost per draft token in target forwards (one row).
"""
from __future__ import annotations

import argparse
import time

import exactspec
from exactspec import fetch
from exactspec.demo import CHAT_PROMPTS, demo_folder
from exactspec.text import chat

TEXT = ("The Rhine is a river that begins in the Swiss Alps, flows through Germany and the Netherlands, and "
        "empties into the North Sea. It is about 1,230 kilometres long. Major cities on the Rhine include "
        "Basel, Strasbourg, Cologne, Düsseldorf and Rotterdam, which has the largest port in Europe.")
CODE = '''def parse(line):
    parts = line.split(",")
    name = parts[0].strip()
    age = int(parts[1])
    email = parts[2].strip().lower()
    return {"name": name, "age": age, "email": email}
'''
MIX = [m for _, m in CHAT_PROMPTS] + [
    "What are the main differences between a list and a tuple in Python?",
    "Write a short poem about the sea.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    f"Add type hints and a docstring to this function, and return the whole function:\n\n```python\n{CODE}```",
    f"List every city mentioned in this text, one per line:\n\n{TEXT}",
    f"Rewrite this text in simpler words, keeping all the facts:\n\n{TEXT}",
]


def run(target, prompts, name, draft, max_new, branches: int = 1) -> dict:
    n = secs = prop = acc = steps = sib = sib_won = 0
    same, at_p, at_a, ids = True, [0] * 16, [0] * 16, []
    for p, want in prompts:
        t = time.perf_counter()
        r = target.generate(p, max_new, draft=draft, num_draft_tokens="auto" if draft is not None else 0,
                            draft_branches=branches)
        secs += time.perf_counter() - t
        n += len(r.token_ids)
        ids.append(r.token_ids)
        prop, acc, steps = prop + r.stats.proposed, acc + r.stats.accepted, steps + r.stats.steps
        sib, sib_won = sib + r.stats.siblings, sib_won + r.stats.sibling_accepted
        for i, (a, b) in enumerate(zip(r.stats.proposed_at[:16], r.stats.accepted_at[:16])):
            at_p[i], at_a[i] = at_p[i] + a, at_a[i] + b
        if want is not None:
            same &= r.token_ids == want
    return dict(name=name, ids=ids, tps=n / secs, acc=acc / prop if prop else float("nan"), same=same, sib=(sib_won, sib),
                per_step=(acc + steps) / steps if steps else 1.0,
                by_pos=[a / p for a, p in zip(at_a, at_p) if p >= 5][:6])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["auto", "bfloat16"])
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--head", default=None, help="a head folder (default: the shipped one)")
    a = ap.parse_args()
    path = fetch.smollm2()
    for dtype in a.dtype:
        target = exactspec.load(path, dtype=dtype, max_context=1024)
        draft = exactspec.load(demo_folder() / "smollm2-draft", dtype="bfloat16" if dtype == "auto" else dtype,
                               max_context=1024)
        head = f"head:{a.head}" if a.head else "head"
        texts = [chat.render(target.tokenizer.config, [{"role": "user", "content": m}]) for m in MIX]
        for d in (None, head, head + "+lookup", "lookup", draft):  # compile, measure the costs "auto" uses
            target.generate(texts[0], 8, draft=d, num_draft_tokens="auto" if d is not None else 0)
        plain = run(target, [(t, None) for t in texts], "plain greedy", None, a.max_new_tokens)
        rows = [plain] + [run(target, list(zip(texts, plain["ids"])), n, d, a.max_new_tokens, b)
                          for n, d, b in (("head", head, 1), ("head + lookup", head + "+lookup", 1),
                                          ("head, tree", head, 3), ("prompt lookup", "lookup", 1),
                                          ("draft model", draft, 1))]
        drafter = target.make_drafter(head)
        cost = drafter.cost_per_token(target.net)
        print(f"\nSmolLM2-135M-Instruct {path.name}, dtype {dtype} ({target.net.dtype}), {len(texts)} chats x up to "
              f"{a.max_new_tokens} tokens; head: {cost:.3f} target forwards per draft token")
        print(f"{'method':<15} {'tok/s':>7} {'vs greedy':>9} {'accept':>7} {'tok/step':>8}  identical  by draft position")
        for r in rows:
            pos = " ".join(f"{x:.2f}" for x in r["by_pos"])
            print(f"{r['name']:<15} {r['tps']:7.1f} {r['tps'] / plain['tps']:8.2f}x {r['acc']:7.1%} "
                  f"{r['per_step']:8.2f}  {'yes' if r['same'] else 'NO':<9}  {pos}" +
                  (f"  (siblings verified {r['sib'][1]}, accepted {r['sib'][0]})" if r["sib"][1] else ""))


if __name__ == "__main__":
    main()
