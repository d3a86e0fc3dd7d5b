"""transformers' own generate(), with and without exactspec.hf's patch, side by side in one run.

    python bench/hf_patch.py [--model demo|0.5b|both] [--dtype bfloat16] [--tokens 128]

demo: the shipped pair (exactspec/assets/target 11M, exactspec/assets/draft 1.65M), a real prompt.
0.5b: random weights in Qwen2.5-0.5B's shape (built in memory), drafter a random 2-layer model of
the same vocabulary (so assisted generation mostly rejects: it measures verify cost) and prompt
lookup (a random model loops, so lookup accepts).

For greedy, assisted and prompt-lookup generation: tokens/s unpatched and patched (median of
--repeat runs for the demo, one run for the 0.5B shape), the ratio
patched/unpatched (>= 1.0: the patch costs nothing), and whether each output equals that
setting's greedy output (unpatched runs may differ; patched runs must not).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import exactspec.hf
from common import QWEN_05B, table

ROOT = Path(__file__).resolve().parent.parent


def demo_pair(dtype: torch.dtype):
    import transformers as tf
    t = tf.AutoModelForCausalLM.from_pretrained(ROOT / "exactspec/assets/target", dtype=dtype).eval()
    d = tf.AutoModelForCausalLM.from_pretrained(ROOT / "exactspec/assets/draft", dtype=dtype).eval()
    tok = tf.PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "exactspec/assets/target/tokenizer.json"))
    ids = torch.tensor([tok.encode("import os\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(")])
    return t, d, ids


def qwen_shape_pair(dtype: torch.dtype):
    import transformers as tf
    torch.manual_seed(0)
    t = tf.Qwen2ForCausalLM(tf.Qwen2Config(**QWEN_05B)).to(dtype).eval()
    d = tf.Qwen2ForCausalLM(tf.Qwen2Config(**{**QWEN_05B, "hidden_size": 224, "intermediate_size": 896,
                                              "num_hidden_layers": 2})).to(dtype).eval()
    ids = torch.randint(2, 32000, (1, 24), generator=torch.Generator().manual_seed(0))
    return t, d, ids


def timed_generate(model, ids: torch.Tensor, tokens: int, repeat: int, **kw) -> tuple[float, torch.Tensor]:
    """Median tokens/s over `repeat` runs, after a warm-up (numba compile/cache load, allocations)."""
    gc = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=8, **gc, **kw)
    speeds = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **gc, **kw)
        speeds.append(tokens / (time.perf_counter() - t))
    return statistics.median(speeds), out


def run(name: str, target, draft, ids: torch.Tensor, tokens: int, repeat: int) -> None:
    settings = [("greedy", {}), ("assisted", dict(assistant_model=draft)),
                ("prompt lookup", dict(prompt_lookup_num_tokens=5))]
    rows = {}
    for patched in (False, True):
        greedy = None
        for label, kw in settings:
            if patched:
                with exactspec.hf.patch(target):
                    speed, out = timed_generate(target, ids, tokens, repeat, **kw)
            else:
                speed, out = timed_generate(target, ids, tokens, repeat, **kw)
            greedy = out if greedy is None else greedy
            rows[(label, patched)] = (speed, torch.equal(out, greedy))
    out = []
    for label, _ in settings:
        (u, ue), (p, pe) = rows[(label, False)], rows[(label, True)]
        out.append((label, f"{u:.1f}", "yes" if ue else "NO", f"{p:.1f}", "yes" if pe else "NO", f"{p / u:.2f}"))
    table(("setting", "unpatched tok/s", "== greedy", "patched tok/s", "== greedy", "patched/unpatched"), out,
          f"{name}: {tokens} new tokens, median of {repeat} runs, dtype {next(target.parameters()).dtype}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="both", choices=["demo", "0.5b", "both"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    import transformers as tf
    tf.logging.set_verbosity_error()
    dtype = getattr(torch, a.dtype)
    print(f"threads: torch {torch.get_num_threads()}; transformers {tf.__version__}")
    if a.model in ("demo", "both"):
        run("demo pair", *demo_pair(dtype), a.tokens, a.repeat)
    if a.model in ("0.5b", "both"):
        run("Qwen2.5-0.5B shape (random)", *qwen_shape_pair(dtype), min(a.tokens, 64), 1)


if __name__ == "__main__":
    main()
