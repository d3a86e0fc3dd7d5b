"""Predicted Outputs: chats that edit a given text, with the text as `prediction`, vs plain greedy and
prompt lookup; same model, same prompts, one run.

    python bench/prediction.py [--model PATH] [--max-new-tokens 200] [--repeat 3]

Prints each method's tokens/s (median over repeats) end to end and after the first token (the
prompt's prefill is the same for all), its ratio to plain greedy, tokens per target forward, the prediction's accepted/rejected draft tokens, and whether the token ids equal plain
greedy's (they must). The default model is the demo's SmolLM2-135M-Instruct Q4_1 file.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import exactspec
from exactspec.text import chat
from common import default_model, table

CODE = '''def mean(items):
    total = 0
    for x in items:
        total += x
    return total / len(items)


def variance(items):
    m = mean(items)
    total = 0
    for x in items:
        total += (x - m) ** 2
    return total / len(items)
'''
LETTER = '''Dear Ms. Novak,

Thank you for your order of 12 blue ceramic mugs on March 3. We shipped them on March 5 by
standard post, and they should reach you within five working days. If anything arrives broken,
reply to this letter with a photo and we will send a replacement at no cost.

Kind regards,
Tom Berger
Customer Service
'''
TASKS = [  # (instruction, the text it edits): the answer repeats most of the text
    ("Rename the function `mean` to `average` in this code. Reply with the whole code only.", CODE),
    ("Add a docstring line to each function of this code. Reply with the whole code only.", CODE),
    ("Change the number of mugs in this letter from 12 to 20. Reply with the whole letter only.", LETTER),
    ("Fix the spelling and reply with the text only:\n", LETTER.replace("receive", "recieve")),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    m = exactspec.load(default_model(a.model))
    prompts = [chat.render(m.tokenizer.config, [{"role": "user", "content": f"{q}\n\n{text}"}]) for q, text in TASKS]
    preds = [text for _, text in TASKS]
    m.generate(prompts[0], 8, draft="lookup", num_draft_tokens="auto")  # compile; measure the verify costs
    methods = [("plain greedy", {}), ("lookup, dynamic k", {"draft": "lookup", "num_draft_tokens": "dynamic"}),
               ("lookup, auto k", {"draft": "lookup", "num_draft_tokens": "auto"}),
               ("prediction (auto k)", {"prediction": preds}),
               ("prediction + lookup", {"prediction": preds, "draft": "lookup", "num_draft_tokens": "auto"})]
    rows, base = [], None
    for name, kw in methods:
        e2e, dec, res = [], [], None
        for _ in range(a.repeat):
            t = time.perf_counter()
            res = [m.generate(p, a.max_new_tokens, **{k: (v[i] if k == "prediction" else v) for k, v in kw.items()})
                   for i, p in enumerate(prompts)]
            wall = time.perf_counter() - t
            e2e.append(sum(len(r.token_ids) for r in res) / wall)
            dec.append(sum(len(r.token_ids) - 1 for r in res) / (wall - sum(r.stats.time_to_first_token for r in res)))
        tps, dps = statistics.median(e2e), statistics.median(dec)
        ids = [r.token_ids for r in res]
        base = base or (tps, dps, ids)
        toks, fwd = sum(len(r.token_ids) for r in res), sum(r.stats.forward_passes for r in res)
        acc = sum(r.stats.prediction_accepted for r in res)
        rej = sum(r.stats.prediction_rejected for r in res)
        rows.append((name, f"{tps:.1f}", f"{tps / base[0]:.2f}x", f"{dps:.1f}", f"{dps / base[1]:.2f}x",
                     f"{toks / fwd:.2f}", f"{acc}/{rej}", "yes" if ids == base[2] else "NO"))
    table(["method", "tok/s", "vs plain", "decode tok/s", "vs plain", "tok/fwd", "pred acc/rej", "identical"], rows,
          f"{len(TASKS)} edit chats x <= {a.max_new_tokens} greedy tokens ({sum(len(i) for i in base[2])} tokens), "
          f"median of {a.repeat}; decode: after the first token")
    if not all(r[-1] == "yes" for r in rows):
        sys.exit("output differs from plain greedy")


if __name__ == "__main__":
    main()
