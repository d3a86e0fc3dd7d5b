"""What int8 activations cost in quality, on a real quantized file (default: the demo's SmolLM2-135M
Q4_1 GGUF): perplexity on a fixed text with activations="int8" and "float32" (the latter is bitwise the
dequantized model), llama.cpp's `llama-perplexity` on the same file and text (which also quantizes its
activations to 8 bits), and how far greedy decoding of chat prompts agrees between the two modes.

    python bench/quant_quality.py [--gguf FILE] [--llama-perplexity PATH] [--llama-server PATH] [--ctx 256] [--chunks 8]

Perplexity as llama-perplexity computes it: the text's tokens cut into chunks of --ctx, each chunk
one forward from its start, the second half of each chunk's tokens scored (each with at least ctx/2
tokens before it). The text: the docstrings of a fixed list of Python standard-library modules
(the same bytes for a given Python; no download). Where the tokenizer adds BOS, each chunk starts with it
(as llama-perplexity does). --llama-server: greedy answers to the 16 chats from llama.cpp's server on the
same file (token ids in, top_k 1), compared with ours.
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
    bos = model.cfg.bos_token_id if model.tokenizer.config.get("add_bos_token") else None
    for c in range(min(chunks, len(ids) // ctx)):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if bos is not None:  # each chunk starts with BOS, as llama-perplexity puts it there
            chunk = [bos] + chunk[1:]
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


def llama_greedy(binary: str, gguf: str, prompts: list[list[int]], tokens: int, threads: int) -> list[list[int]]:
    """llama-server's greedy answers (top_k 1, temperature 0, no prompt cache) to prompts given as token ids."""
    import json
    import socket
    import time
    import urllib.request
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen([binary, "-m", gguf, "-t", str(threads), "--port", str(port), "-c", "2048", "-np", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except Exception:
                time.sleep(0.2)
        out = []
        for p in prompts:
            body = json.dumps({"prompt": p, "n_predict": tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
                               "return_tokens": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
            out.append(json.loads(urllib.request.urlopen(req, timeout=300).read())["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    import exactspec
    from exactspec.tools import fetch
    from exactspec.text.chat import render
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None, help="default: the demo's SmolLM2-135M-Instruct Q4_1 file")
    ap.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity binary")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: greedy chats against it")
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
    m8 = models["int8"]  # the rendered chat carries its BOS where the template writes one: no second BOS
    prompts = [m8.encode_text(render(m8.tokenizer.config, [{"role": "user", "content": c}])) for c in CHATS]
    answers = {act: [m.generate(p, a.tokens).token_ids for p in prompts] for act, m in models.items()}
    if a.llama_server:
        answers["llama-server"] = llama_greedy(a.llama_server, gguf, prompts, a.tokens, a.threads)
    for other in [k for k in answers if k != "int8"]:
        same, agree = 0, []
        for x, y in zip(answers["int8"], answers[other]):
            n = min(len(x), len(y))
            agree.append(next((i for i in range(n) if x[i] != y[i]), n))
            same += agree[-1] == n
        agree.sort()
        print(f"\ngreedy chats, ours (int8 activations) vs {other}: {same} of {len(CHATS)} identical up to the shorter "
              f"answer (<= {a.tokens} tokens); tokens before the first difference: median {agree[len(agree) // 2]}, "
              f"min {agree[0]}")


if __name__ == "__main__":
    main()
