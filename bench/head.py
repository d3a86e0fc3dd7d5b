"""Drafters on SmolLM2-135M-Instruct chats, one run side by side: plain greedy, the shipped hidden-state
head, the head beside prompt lookup, the head with tree verification (up to 2 runners-up of its first
token verified beside the draft where the measured costs say so), prompt lookup, the distilled draft
model; each with the same "auto" draft length.

    python bench/head.py [--dtype auto bfloat16] [--max-new-tokens 160] [--repeat 3] [--head PATH] [--methods NAME ...]

A mix of chats (the demo's three plus general chat, code writing) and three prompts that edit or quote a
given text (add type hints to a function, list the cities of a text, rewrite a text), reported apart and
together. Each (method, prompt) runs --repeat times, interleaved; its fastest run counts (this 2-core VM's
speed drifts by 20% within minutes). Prints per method, group and dtype: tokens/s end to end (prefill
included), the ratio to plain greedy, acceptance,
acceptance by draft position (the share of steps that proposed a token there and had it accepted),
tokens per verify step, and whether every answer equals plain greedy's (it must). For the head also
its measured cost per draft token in target forwards (one row).
"""
from __future__ import annotations

import argparse
import time

import exactspec
from exactspec.tools import fetch
from exactspec.tools.demo import CHAT_PROMPTS, demo_folder
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


EDITS = 3  # the last three of MIX edit or quote a given text (the second target)


def run(target, texts, methods, max_new, repeat: int) -> list[dict]:
    """Every method on every prompt, `repeat` times interleaved (prompt by prompt, method by method, so a slow
    spell of the machine hits all alike); a prompt's time is its fastest run. Per method and group of prompts
    (chats, edits, all): tokens/s, acceptance, acceptance by draft position, tokens per verify step, and
    whether every answer equals plain greedy's."""
    best: dict = {}
    res: dict = {}
    for _ in range(repeat):
        for i, p in enumerate(texts):
            for name, draft, branches in methods:
                t = time.perf_counter()
                r = target.generate(p, max_new, draft=draft, num_draft_tokens="auto" if draft is not None else 0,
                                    draft_branches=branches)
                best[name, i] = min(best.get((name, i), float("inf")), time.perf_counter() - t)
                res[name, i] = r
    groups = {"chats": range(len(texts) - EDITS), "edits": range(len(texts) - EDITS, len(texts)),
              "all": range(len(texts))}
    rows = []
    for g, idx in groups.items():
        for name, _, _ in methods:
            rs = [res[name, i] for i in idx]
            n, secs = sum(len(r.token_ids) for r in rs), sum(best[name, i] for i in idx)
            prop, acc, steps = (sum(getattr(r.stats, f) for r in rs) for f in ("proposed", "accepted", "steps"))
            at_p, at_a = [0] * 16, [0] * 16
            for r in rs:
                for j, (x, y) in enumerate(zip(r.stats.proposed_at[:16], r.stats.accepted_at[:16])):
                    at_p[j], at_a[j] = at_p[j] + x, at_a[j] + y
            rows.append(dict(group=g, name=name, tps=n / secs, acc=acc / prop if prop else float("nan"),
                             same=all(res[name, i].token_ids == res[methods[0][0], i].token_ids for i in idx),
                             sib=(sum(r.stats.sibling_accepted for r in rs), sum(r.stats.siblings for r in rs)),
                             per_step=(acc + steps) / steps if steps else 1.0,
                             by_pos=[x / y for x, y in zip(at_a, at_p) if y >= 5][:6]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["auto", "bfloat16"])
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each (method, prompt); its fastest counts")
    ap.add_argument("--head", default=None, help="a head folder (default: the shipped one)")
    ap.add_argument("--methods", nargs="+", default=None, help="only these (names as printed; greedy always runs)")
    a = ap.parse_args()
    path = fetch.smollm2()
    for dtype in a.dtype:
        target = exactspec.load(path, dtype=dtype, max_context=1024)
        draft = exactspec.load(demo_folder() / "smollm2-draft", dtype="bfloat16" if dtype == "auto" else dtype,
                               max_context=1024)
        head = f"head:{a.head}" if a.head else "head"
        texts = [chat.render(target.tokenizer.config, [{"role": "user", "content": m}]) for m in MIX]
        methods = [("plain greedy", None, 1), ("head", head, 1), ("head + lookup", head + "+lookup", 1),
                   ("head, tree", head, 3), ("prompt lookup", "lookup", 1), ("draft model", draft, 1)]
        methods = [m for m in methods if a.methods is None or m[1] is None or m[0] in a.methods]
        for _, d, b in methods:  # compile, measure the costs "auto" uses
            target.generate(texts[0], 8, draft=d, num_draft_tokens="auto" if d is not None else 0, draft_branches=b)
        rows = run(target, texts, methods, a.max_new_tokens, a.repeat)
        drafter = target.make_drafter(head)
        cost = drafter.cost_per_token(target.net)
        print(f"\nSmolLM2-135M-Instruct {path.name}, dtype {dtype} ({target.net.dtype}), {len(texts)} prompts "
              f"({len(texts) - EDITS} chats, {EDITS} edits of a given text) x up to {a.max_new_tokens} tokens, "
              f"fastest of {a.repeat}; head: {cost:.3f} target forwards per draft token")
        print(f"{'group':<6} {'method':<15} {'tok/s':>7} {'vs greedy':>9} {'accept':>7} {'tok/step':>8}  identical  "
              "by draft position")
        base = {r["group"]: r["tps"] for r in rows if r["name"] == "plain greedy"}
        for r in rows:
            pos = " ".join(f"{x:.2f}" for x in r["by_pos"])
            print(f"{r['group']:<6} {r['name']:<15} {r['tps']:7.1f} {r['tps'] / base[r['group']]:8.2f}x {r['acc']:7.1%} "
                  f"{r['per_step']:8.2f}  {'yes' if r['same'] else 'NO':<9}  {pos}" +
                  (f"  (siblings verified {r['sib'][1]}, accepted {r['sib'][0]})" if r["sib"][1] else ""))


if __name__ == "__main__":
    main()
