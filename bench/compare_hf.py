"""exactspec vs Hugging Face transformers on the same checkpoint and prompts, in one run.

    python bench/compare_hf.py [--target exactspec/assets/target --draft exactspec/assets/draft] [--max-new-tokens 128]

For float32 and bfloat16: tokens/s of transformers' greedy `generate`, `generate(assistant_model=)`
and `generate(prompt_lookup_num_tokens=)`, and of ours (plain, draft model, prompt lookup); the
ratio of each to transformers' greedy; and for each run whether its token ids equal its own
framework's greedy output (if not: the first new-token index where it diverges). Writes a PNG
plot: tokens/s per method and our acceptance by draft position.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import exactspec
from exactspec.tools.demo import PROMPTS, demo_folder
from exactspec.hf.diff import first_divergence


def run_hf(folder: Path, draft_folder: Path, dtype: torch.dtype, n: int, k: int) -> dict:
    import transformers as tf
    tok = tf.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    draft = tf.AutoModelForCausalLM.from_pretrained(draft_folder, dtype=dtype).eval()
    eos = model.generation_config.eos_token_id
    kinds = {"HF greedy": {}, "HF assisted": {"assistant_model": draft},
             "HF prompt lookup": {"prompt_lookup_num_tokens": k}}
    out = {}
    with torch.no_grad():
        ids = torch.tensor([tok.encode(PROMPTS[0])])
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=eos)  # warm up
        for name, kw in kinds.items():
            toks, secs, seqs = 0, 0.0, []
            for p in PROMPTS:
                ids = torch.tensor([tok.encode(p)])
                t = time.perf_counter()
                g = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=eos, **kw)
                secs += time.perf_counter() - t
                new = g[0, ids.shape[1]:].tolist()
                toks += len(new)
                seqs.append(new)
            out[name] = dict(tps=toks / secs, ids=seqs)
    return out


def run_ours(folder: Path, draft_folder: Path, dtype: str, n: int, k: int) -> dict:
    model = exactspec.load(folder, dtype=dtype)
    draft = exactspec.load(draft_folder, dtype=dtype)
    model.generate(PROMPTS[0], 4, draft=draft)  # warm up
    out = {}
    for name, d in [("ours greedy", None), ("ours draft", draft), ("ours lookup", "lookup")]:
        toks, secs, seqs = 0, 0.0, []
        prop, acc = [0] * k, [0] * k
        for p in PROMPTS:
            t = time.perf_counter()
            r = model.generate(p, n, draft=d, num_draft_tokens=k if d is not None else 0)
            secs += time.perf_counter() - t
            toks += len(r.token_ids)
            seqs.append(r.token_ids)
            for i, (a, b) in enumerate(zip(r.stats.proposed_at, r.stats.accepted_at)):
                prop[i] += a
                acc[i] += b
        out[name] = dict(tps=toks / secs, ids=seqs, by_pos=[a / b if b else 0.0 for a, b in zip(acc, prop)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(demo_folder() / "target"))
    ap.add_argument("--draft", default=str(demo_folder() / "draft"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--png", default="bench/out/compare_hf.png")
    a = ap.parse_args()
    exactspec.set_num_threads(a.threads)
    tdir, ddir = Path(a.target), Path(a.draft)
    results = {}
    for dname, tdt in [("float32", torch.float32), ("bfloat16", torch.bfloat16)]:
        hf = run_hf(tdir, ddir, tdt, a.max_new_tokens, a.k)
        ours = run_ours(tdir, ddir, dname, a.max_new_tokens, a.k)
        results[dname] = (hf, ours)
        base = hf["HF greedy"]["tps"]
        print(f"\n== {dname} weights ({len(PROMPTS)} prompts x {a.max_new_tokens} new tokens, k={a.k}, "
              f"{a.threads} threads)")
        print(f"{'method':<18} {'tok/s':>8} {'vs HF greedy':>13}  same ids as own greedy")
        for group, ref in ((hf, "HF greedy"), (ours, "ours greedy")):
            for name, r in group.items():
                diffs = [first_divergence(x, y) for x, y in zip(r["ids"], group[ref]["ids"])]
                same = "yes" if all(d is None for d in diffs) else \
                    "NO: diverges at new token " + ", ".join("-" if d is None else str(d) for d in diffs)
                print(f"{name:<18} {r['tps']:8.1f} {r['tps'] / base:12.2f}x  {same}")
        agree = [first_divergence(x, y) for x, y in zip(ours["ours greedy"]["ids"], hf["HF greedy"]["ids"])]
        print("ours greedy vs HF greedy (first difference per prompt; HF bfloat16 rounds activations to "
              "bfloat16, ours keeps float32):", ["-" if d is None else d for d in agree])
        print("our draft acceptance by draft position:", " ".join(f"{x:.2f}" for x in ours["ours draft"]["by_pos"]))
    plot(results, Path(a.png))
    print(f"\nplot: {a.png}")


def plot(results: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    png.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(results["float32"][0]) + list(results["float32"][1])
    w = 0.4
    for j, (dname, (hf, ours)) in enumerate(results.items()):
        vals = [{**hf, **ours}[n]["tps"] for n in names]
        ax1.bar([i + (j - 0.5) * w for i in range(len(names))], vals, w, label=dname)
        ax2.plot(range(1, len(ours["ours draft"]["by_pos"]) + 1), ours["ours draft"]["by_pos"], marker="o",
                 label=f"draft model, {dname}")
    ax1.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax1.set_ylabel("tokens / s")
    ax1.set_title("decoding speed (batch 1, CPU)")
    ax1.legend()
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("P(accepted | proposed)")
    ax2.set_ylim(0, 1)
    ax2.set_title("exactspec acceptance by draft position")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
