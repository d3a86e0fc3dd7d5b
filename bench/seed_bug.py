"""The seed thread's bug, reproduced on a real model: transformers' assisted generation drifts from
its own greedy output; under exactspec.hf.patch it does not; exactspec's engine never does.

    python bench/seed_bug.py [--tokens 256] [--prompts 8] [--dtype bfloat16] [--skip-patched]

SmolLM2-135M-Instruct (the demo model's GGUF, loaded by transformers itself and dequantized to
--dtype), chat prompts, greedy vs prompt lookup (prompt_lookup_num_tokens=10) vs the shipped
distilled draft as assistant_model (exactspec/assets/smollm2-draft, when present). For each setting: how many
prompts diverge from that run's plain greedy, and the first divergent token. Then `exactspec diff`'s
explanation of the first unpatched divergence. eos is ignored so every run has --tokens tokens.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch

import exactspec
import exactspec.hf
from exactspec.text import chat
from exactspec.hf import diff
from exactspec.tools import fetch
from common import table as markdown_table

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Write a short poem about the sea.",
    "Summarize the plot of Romeo and Juliet.",
    "How do I read a CSV file with pandas? Show code.",
    "List five tips for better sleep.",
    "Explain what a binary search tree is.",
    "Translate 'good morning, how are you?' into French and Spanish.",
]


def hf_runs(target, draft, prompts: list[list[int]], tokens: int, patched: bool) -> dict[str, list[list[int]]]:
    settings = {"greedy": {}, "prompt lookup": dict(prompt_lookup_num_tokens=10)}
    if draft is not None:
        settings["draft model"] = dict(assistant_model=draft)
    out: dict[str, list[list[int]]] = {k: [] for k in settings}
    ctx = exactspec.hf.patch(target) if patched else contextlib.nullcontext()
    with ctx, torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            for name, kw in settings.items():
                # an explicit mask: the pad id (<|im_end|>) is inside every chat prompt
                seq = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens,
                                      min_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=2, **kw)
                out[name].append(seq[0].tolist())
    return out


def table(title: str, runs: dict[str, list[list[int]]], n_prompt: list[int], seconds: float) -> list[tuple]:
    found, rows = [], []
    for name, seqs in runs.items():
        if name == "greedy":
            continue
        firsts = []
        for i, (a, b) in enumerate(zip(runs["greedy"], seqs)):
            p = diff.first_divergence(a, b)
            if p is not None:
                firsts.append(p - n_prompt[i])
                found.append((name, i, a, b))
        rows.append((name, f"{len(firsts)} / {len(seqs)}", ", ".join(map(str, firsts)) or "-"))
    markdown_table(("setting", "prompts diverging from greedy", "first divergent token (per diverging prompt)"), rows,
          f"{title} ({seconds:.0f} s)")
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--skip-patched", action="store_true")
    a = ap.parse_args()
    import transformers as tf
    tf.logging.set_verbosity_error()
    tf.logging.disable_progress_bar()
    path = fetch.smollm2()
    dtype = getattr(torch, a.dtype)
    target = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    draft_dir = ROOT / "exactspec" / "assets" / "smollm2-draft"
    draft = tf.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval() if draft_dir.is_dir() else None
    ours = exactspec.load(path, dtype=a.dtype, max_context=1024)
    msgs = PROMPTS[:a.prompts]
    prompts = [ours.encode(chat.render(ours.tokenizer.config, [{"role": "user", "content": m}])) for m in msgs]
    n_prompt = [len(p) for p in prompts]
    print(f"SmolLM2-135M-Instruct, {a.dtype}, {len(prompts)} chat prompts x {a.tokens} new tokens, transformers "
          f"{tf.__version__}, torch threads {torch.get_num_threads()}")

    t = time.time()
    runs = hf_runs(target, draft, prompts, a.tokens, patched=False)
    found = table("transformers generate, unpatched", runs, n_prompt, time.time() - t)
    if not a.skip_patched:
        t = time.time()
        table("transformers generate under exactspec.hf.patch", hf_runs(target, draft, prompts, a.tokens, True),
              n_prompt, time.time() - t)

    t = time.time()
    dm = exactspec.load(draft_dir, dtype=a.dtype, max_context=1024) if draft is not None else None
    ours_runs = {"greedy": [], "prompt lookup": [], **({"draft model": []} if dm is not None else {})}
    for ids in prompts:
        for name, d in (("greedy", None), ("prompt lookup", "lookup"), ("draft model", dm)):
            if name in ours_runs:
                r = ours.generate(ids, a.tokens, ignore_eos=True, draft=d, num_draft_tokens="dynamic")
                ours_runs[name].append(ids + r.token_ids)
    table("exactspec engine (dynamic k)", ours_runs, n_prompt, time.time() - t)

    if found:
        name, i, seq_a, seq_b = found[0]
        report = diff.explain(target, seq_a, seq_b, n_prompt[i], ours.tokenizer)
        print(f"\nexactspec diff on the first unpatched divergence ({name}, prompt {i}, new token "
              f"{report.get('new_token_index')}): verdict: {report.get('verdict')}\n  {report.get('reason')}")


if __name__ == "__main__":
    main()
