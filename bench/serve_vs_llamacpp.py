"""`exactspec serve` vs llama.cpp's `llama-server` on the same GGUF file and chat prompts, side by side.

    # llama-server, built from the llama-cpp-python sdist's own llama.cpp (about 10 minutes on 2 cores):
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2 --target llama-server
    python bench/serve_vs_llamacpp.py --llama-server .../build/bin/llama-server [--model FILE] \
        [--clients 1 4 8] [--tokens 128] [--threads 2]

One server at a time on loopback (their thread pools would fight over the cores), each with as many
slots as the largest client count, greedy chat completions of --tokens tokens (EOS ends one earlier),
streamed. For each client count C: C clients each send their share of the prompts at once; prints
completion tokens/s over the whole run, time to first token p50/p99, and whether every text equals
that server's own C=1 text for the same prompt (exactspec: always, by construction; llama.cpp
batches with other numerics)."""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import time
import httpx

from common import default_model, http_server, serving, table

PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about autumn rain.",
           "Explain what a hash table is to a beginner.", "Give three tips for writing clean Python code.",
           "Translate 'good morning, how are you?' into Spanish and French.", "What causes the seasons on Earth?",
           "Write a short Python function that reverses a string.", "Summarize the plot of Romeo and Juliet.",
           "List five fruits that are high in vitamin C.", "Why is the sky blue? Keep it short.",
           "Suggest a name for a friendly robot and explain why.", "What is the difference between TCP and UDP?",
           "Describe a cat to someone who has never seen one.", "How do I boil an egg?",
           "Write a limerick about a programmer.", "What are prime numbers? Give examples."]


def llama_server(binary: str, model: str, slots: int, threads: int, ctx_per_slot: int = 2048):
    return http_server(lambda port: [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t",
                                     str(threads), "-np", str(slots), "-c", str(ctx_per_slot * slots), "--no-webui"])


def chat(url: str, prompt: str, tokens: int) -> tuple[str, int, float]:
    """(text, completion tokens, seconds to the first content chunk) of one streamed greedy chat."""
    body = dict(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0.0,
                stream=True, stream_options={"include_usage": True})
    t0, first, text, n, chunks = time.perf_counter(), None, [], None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    first = first if first is not None else time.perf_counter() - t0
                    text.append(piece)
                    chunks += 1
            if ev.get("usage"):
                n = ev["usage"]["completion_tokens"]
    return "".join(text), n if n is not None else chunks, first if first is not None else time.perf_counter() - t0


def load(url: str, clients: int, tokens: int) -> dict:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as ex:
        got = list(ex.map(lambda p: chat(url, p, tokens), PROMPTS))
    wall = time.perf_counter() - t0
    ttft = sorted(g[2] for g in got)
    return dict(texts=[g[0] for g in got], tps=sum(g[1] for g in got) / wall, p50=statistics.median(ttft),
                p99=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))])


def run_side(url: str, clients: list[int], tokens: int) -> dict[int, dict]:
    chat(url, "Hello", 4)  # warm-up
    return {c: load(url, c, tokens) for c in clients}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True, help="path of llama.cpp's llama-server binary")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the demo's SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    model = default_model(a.model)
    slots = max(a.clients)
    with serving("--model", model, "--threads", str(a.threads), "--max-batch", str(slots)) as url:
        ours = run_side(url, a.clients, a.tokens)
    with llama_server(a.llama_server, model, slots, a.threads) as url:
        theirs = run_side(url, a.clients, a.tokens)
    rows = []
    for c in a.clients:
        o, t = ours[c], theirs[c]
        rows.append((c, f"{o['tps']:.1f}", f"{t['tps']:.1f}", f"{o['tps'] / t['tps']:.2f}",
                     f"{o['p50']:.3f} / {o['p99']:.3f}", f"{t['p50']:.3f} / {t['p99']:.3f}",
                     f"{sum(x == y for x, y in zip(o['texts'], ours[a.clients[0]]['texts']))}/{len(PROMPTS)}",
                     f"{sum(x == y for x, y in zip(t['texts'], theirs[a.clients[0]]['texts']))}/{len(PROMPTS)}"))
    table(("clients", "exactspec tok/s", "llama-server tok/s", "ratio", "exactspec TTFT p50/p99 (s)",
           "llama-server TTFT p50/p99 (s)", f"exactspec texts = its C={a.clients[0]}",
           f"llama-server texts = its C={a.clients[0]}"), rows,
          f"{model}, {len(PROMPTS)} chats x <= {a.tokens} greedy tokens, {a.threads} threads, {slots} slots each")


if __name__ == "__main__":
    main()
