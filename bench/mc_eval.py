"""A small multiple-choice loglikelihood evaluation, as lm-evaluation-harness runs one against an
OpenAI-style server (`local-completions`: for each choice, the context + continuation as token
ids with echo, max_tokens 0, logprobs, summing the continuation's token logprobs), through
`exactspec serve`, and the same sums from transformers' own forward of the same model.

    python bench/mc_eval.py [--model PATH]     # default: SmolLM2-135M-Instruct (cached), else the toy target

Prints each side's accuracy (argmax of the summed loglikelihood), how many items' choices agree,
and the largest |difference| of a loglikelihood (float32 vs float32: close, not equal: a
different kernel order). The items are written here; nothing is downloaded but the model.
"""
from __future__ import annotations

import argparse

import httpx
import torch

from common import default_model, serving

ITEMS = [  # (context, choices, index of the right one)
    ("The capital of France is", [" Paris", " Berlin", " Madrid", " Rome"], 0),
    ("Water freezes at a temperature of", [" 0 degrees Celsius", " 50 degrees Celsius", " 100 degrees Celsius"], 0),
    ("The largest planet in the solar system is", [" Jupiter", " Mars", " Mercury", " Venus"], 0),
    ("In Python, a list is written with", [" square brackets", " curly braces", " angle brackets"], 0),
    ("The opposite of hot is", [" cold", " warm", " loud", " tall"], 0),
    ("Two plus two equals", [" four", " five", " seven", " ten"], 0),
    ("A week has seven", [" days", " months", " years", " hours"], 0),
    ("The sun rises in the", [" east", " west", " north", " basement"], 0),
]


def server_scores(url: str, tok, items) -> list[list[float]]:
    out = []
    for ctx, choices, _ in items:
        c_ids = tok.encode(ctx)
        row = []
        for ch in choices:
            cont = tok.encode(ch, add_special_tokens=False)
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "m", "prompt": c_ids + cont, "max_tokens": 0, "echo": True, "logprobs": 0})
            r.raise_for_status()
            lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            row.append(sum(lps[len(c_ids):]))
        out.append(row)
    return out


def hf_scores(model, tok, items) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for ctx, choices, _ in items:
            c_ids = tok.encode(ctx)
            row = []
            for ch in choices:
                ids = c_ids + tok.encode(ch, add_special_tokens=False)
                lp = torch.log_softmax(model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0]
                                       .float(), -1)
                row.append(sum(float(lp[i - 1, ids[i]]) for i in range(len(c_ids), len(ids))))
            out.append(row)
    return out


def main() -> None:
    from exactspec.hf.diff import load_hf
    from exactspec.model.checkpoint import load_tokenizer
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    model = default_model(a.model)
    tok = load_tokenizer(model)
    with serving("--model", model, "--dtype", "float32") as url:
        ours = server_scores(url, tok, ITEMS)
    theirs = hf_scores(load_hf(model, "float32"), tok, ITEMS)

    def acc(scores):
        return sum(max(range(len(r)), key=r.__getitem__) == it[2] for r, it in zip(scores, ITEMS)) / len(ITEMS)
    agree = sum(max(range(len(x)), key=x.__getitem__) == max(range(len(y)), key=y.__getitem__)
                for x, y in zip(ours, theirs))
    diff = max(abs(p - q) for x, y in zip(ours, theirs) for p, q in zip(x, y))
    print(f"model: {model}; {len(ITEMS)} items, loglikelihood of each choice, argmax")
    print(f"exactspec serve (echo, max_tokens 0): accuracy {acc(ours):.3f}")
    print(f"transformers forward, float32:        accuracy {acc(theirs):.3f}")
    print(f"items whose chosen answer agrees: {agree} / {len(ITEMS)}; max |loglikelihood difference| {diff:.2e}")


if __name__ == "__main__":
    main()
