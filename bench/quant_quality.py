"""What int8 activations cost in quality, on a real quantized file (default: the demo's SmolLM2-135M
Q4_1 GGUF): perplexity on a fixed text with activations="int8" and "float32" (the latter is bitwise the
dequantized model), llama.cpp's `llama-perplexity` on the same file and text (which also quantizes its
activations to 8 bits), and how far greedy decoding of chat prompts agrees between the two modes.

    python bench/quant_quality.py [--gguf FILE] [--llama-perplexity PATH] [--ctx 256] [--chunks 8]

Perplexity as llama-perplexity computes it: the text's tokens cut into chunks of --ctx, each chunk
one forward from its start, the second half of each chunk's tokens scored (each with at least ctx/2
tokens before it). The text: the docstrings of a fixed list of Python standard-library modules
(the same bytes for a given Python; no download).
"""
from __future__ import annotations

import argparse
import importlib
import math
import re
import subprocess
import tempfile
from pathlib import Path

from common import table

MODULES = ("argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
           "dataclasses", "datetime", "decimal", "difflib", "email", "fractions", "functools", "glob", "heapq",
           "html", "http", "imaplib", "inspect", "ipaddress", "json", "logging", "mailbox", "numbers", "optparse",
           "pathlib", "pickle", "pprint", "queue", "random", "shlex", "shutil", "smtplib", "socket", "string",
           "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "typing",
           "unittest", "urllib", "uuid", "warnings", "weakref", "zipfile")
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "How do I reverse a list in Python?",
         "Explain photosynthesis to a child.", "List three prime numbers.", "What is 17 times 23?",
         "Give me a tip for better sleep.", "Translate 'good morning' into Spanish.",
         "What does a compiler do?", "Name a famous painting and its painter.", "Why is the sky blue?",
         "Write a short poem about autumn.", "What is a linked list?", "How many legs does a spider have?",
         "Suggest a name for a cat.", "What is the boiling point of water?"]


def text() -> str:
    docs = [importlib.import_module(m).__doc__ or "" for m in MODULES]
    return "\n\n".join(d.strip() for d in docs if d.strip())


def perplexity(model, ids: list[int], ctx: int, chunks: int) -> float:
    nll, n = 0.0, 0
    for c in range(min(chunks, len(ids) // ctx)):
        chunk = ids[c * ctx:(c + 1) * ctx]
        lps = model.score(chunk[:1], chunk[1:])  # lps[i] predicts chunk[i + 1]
        for lp in lps[ctx // 2 - 1:]:
            nll -= lp.logprob
            n += 1
    return math.exp(nll / n)


def llama_perplexity(binary: str, gguf: str, body: str, ctx: int, chunks: int, threads: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "text.txt"
        f.write_text(body)
        out = subprocess.run([binary, "-m", gguf, "-f", str(f), "-c", str(ctx), "--chunks", str(chunks), "-t",
                              str(threads), "-b", str(ctx)], capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not m:
        raise SystemExit(f"llama-perplexity gave no estimate:\n{(out.stdout + out.stderr)[-3000:]}")
    return float(m.group(1))


def main() -> None:
    import exactspec
    from exactspec.tools import fetch
    from exactspec.text.chat import render
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None, help="default: the demo's SmolLM2-135M-Instruct Q4_1 file")
    ap.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity binary")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per chat")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    exactspec.set_num_threads(a.threads)
    gguf = a.gguf or str(fetch.smollm2())
    body = text()
    models = {act: exactspec.load(gguf, activations=act, max_context=max(a.ctx, 1024)) for act in ("int8", "float32")}
    ids = models["int8"].tokenizer.encode(body)
    rows = [(f"ours, activations {act}", f"{perplexity(m, ids, a.ctx, a.chunks):.4f}") for act, m in models.items()]
    if a.llama_perplexity:
        rows.append(("llama-perplexity (same file, same text)",
                     f"{llama_perplexity(a.llama_perplexity, gguf, body, a.ctx, a.chunks, a.threads):.4f}"))
    table(("perplexity", f"{a.chunks} chunks of {a.ctx} tokens, second halves scored"), rows,
          title=f"{Path(gguf).name}: {len(ids)} tokens of text")
    same, agree = 0, []
    for chat in CHATS:
        prompt = render(models["int8"].tokenizer.config, [{"role": "user", "content": chat}])
        outs = [m.generate(prompt, a.tokens).token_ids for m in models.values()]
        first = next((i for i, (x, y) in enumerate(zip(*outs)) if x != y), min(map(len, outs)))
        same += outs[0] == outs[1]
        agree.append(first)
    agree.sort()
    print(f"\ngreedy chats, int8 vs float32 activations: {same} of {len(CHATS)} identical over {a.tokens} tokens; "
          f"tokens before the first difference: median {agree[len(agree) // 2]}, min {agree[0]}")


if __name__ == "__main__":
    main()
