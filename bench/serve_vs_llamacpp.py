"""`exactspec serve` vs llama.cpp's `llama-server` on the same GGUF file and chat prompts, side by side.

    # llama-server, built from the llama-cpp-python sdist's own llama.cpp (about 10 minutes on 2 cores):
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2 --target llama-server
    python bench/serve_vs_llamacpp.py --llama-server .../build/bin/llama-server [--model FILE] \
        [--clients 1 4 8] [--tokens 128] [--threads 2] [--spec [--llama-draft DRAFT.gguf]] [--system-tokens 500]

One server at a time on loopback (their thread pools would fight over the cores), each with as many
slots as the largest client count, greedy chat completions of --tokens tokens (EOS ends one earlier),
streamed. For each client count C: C clients each send their share of the prompts at once; prints
completion tokens/s over the whole run, time to first token p50/p99, and whether every text equals
that server's own C=1 text for the same prompt (exactspec: always, by construction; llama.cpp
batches with other numerics)."""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
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


def llama_server(binary: str, model: str, slots: int, threads: int, ctx_per_slot: int = 2048, extra: list[str] = ()):
    return http_server(lambda port: [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t",
                                     str(threads), "-np", str(slots), "-c", str(ctx_per_slot * slots), "--no-webui",
                                     *extra])


def chat(url: str, prompt: str, tokens: int, system: str | None = None, extra: dict | None = None
         ) -> tuple[str, int, float]:
    """(text, completion tokens, seconds to the first content chunk) of one streamed greedy chat."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    body = dict(model="m", messages=messages, max_tokens=tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, **(extra or {}))
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


def one_by_one(url: str, prompts: list[str], tokens: int, system: str | None = None, extra: dict | None = None
               ) -> dict:
    """The prompts one at a time (1 client): completion tok/s, TTFT median, texts."""
    chat(url, "Hello", 4, system, extra)  # warm-up (with a system prompt: it is now cached, where caching is on)
    t0 = time.perf_counter()
    got = [chat(url, p, tokens, system, extra) for p in prompts]
    return dict(tps=sum(g[1] for g in got) / (time.perf_counter() - t0), texts=[g[0] for g in got],
                ttft=statistics.median(g[2] for g in got))


def spec_methods(a, model: str) -> None:
    """Each side's speculative methods, 1 client: tok/s over its own greedy, texts equal its own greedy."""
    from exactspec.tools.demo import demo_folder
    prompts = PROMPTS[: a.spec_prompts]
    ours = [("greedy", []), ("lookup", ["--draft", "lookup"]), ("pool", ["--draft", "pool"]),
            ("head", ["--draft", "head"]), ("head+pool", ["--draft", "head+pool"]), ("draft model", ["--draft", str(demo_folder() / "smollm2-draft")])]
    theirs = [("greedy", []), ("ngram-mod", ["--spec-type", "ngram-mod"]), ("ngram-cache", ["--spec-type", "ngram-cache"])]
    if a.llama_draft:
        theirs.append(("draft-simple", ["--spec-type", "draft-simple", "-md", a.llama_draft]))
    rows = []
    for side, methods, start in (
            ("exactspec", ours, lambda extra: serving("--model", model, "--threads", str(a.threads), "--max-batch", "1",
                                                       *extra, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))),
            ("llama-server", theirs, lambda extra: llama_server(a.llama_server, model, 1, a.threads, extra=extra))):
        # every method's server up at once (idle ones sleep), each prompt sent to each in turn: a slow spell of
        # the machine hits every method alike. One pass (a pool would answer a repeated prompt from its copy).
        with contextlib.ExitStack() as stack:
            urls = {name: stack.enter_context(start(extra)) for name, extra in methods}
            for url in urls.values():
                chat(url, "Hello", 4)  # warm-up
            got: dict[str, list] = {name: [] for name in urls}
            for p in prompts:
                for name, url in urls.items():
                    t0 = time.perf_counter()
                    text, n, _ = chat(url, p, a.tokens)
                    got[name].append((text, n, time.perf_counter() - t0))
        base = None
        for name, r in got.items():
            tps = sum(g[1] for g in r) / sum(g[2] for g in r)
            base = base or (tps, [g[0] for g in r])
            rows.append((side, name, f"{tps:.1f}", f"{tps / base[0]:.2f}x",
                         f"{sum(g[0] == t for g, t in zip(r, base[1]))}/{len(prompts)}"))
    table(("server", "method", "tok/s", "vs its greedy", "texts = its greedy"), rows,
          f"{model}: speculative methods, 1 client, {len(prompts)} chats x <= {a.tokens} greedy tokens, {a.threads} threads")


def system_prompt(a, model: str) -> None:
    """A repeated ~500-token system prompt, one client: TTFT with each side's prefix reuse off and on."""
    import exactspec
    tok = exactspec.load(model).tokenizer
    unit = "You are a helpful assistant for a hardware store. Be brief, be kind, and never invent prices. "
    system = unit * (a.system_tokens // len(tok.encode(unit, add_special_tokens=False)) + 1)
    qs, rows = PROMPTS[:6], []
    res = {}
    for mb in (0, 256):
        with serving("--model", model, "--threads", str(a.threads), "--max-batch", "1", "--prefix-cache-mb",
                     str(mb)) as url:
            res["exactspec", mb > 0] = one_by_one(url, qs, 32, system)
    with llama_server(a.llama_server, model, 1, a.threads) as url:
        for on in (False, True):
            res["llama-server", on] = one_by_one(url, qs, 32, system, {"cache_prompt": on})
    for side in ("exactspec", "llama-server"):
        off, on = res[side, False], res[side, True]
        rows.append((side, f"{off['ttft']:.3f}", f"{on['ttft']:.3f}", f"{off['ttft'] / on['ttft']:.1f}x",
                     f"{sum(x == y for x, y in zip(on['texts'], off['texts']))}/{len(qs)}"))
    table(("server", "TTFT off (s)", "TTFT on (s)", "off / on", "texts on = off"), rows,
          f"{model}: a {len(tok.encode(system, add_special_tokens=False))}-token system prompt + {len(qs)} questions, "
          "one at a time, prefix reuse off / on (exactspec --prefix-cache-mb 0 / 256; llama-server cache_prompt)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True, help="path of llama.cpp's llama-server binary")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the demo's SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spec", action="store_true", help="also each side's speculative methods (1 client)")
    ap.add_argument("--spec-prompts", type=int, default=8)
    ap.add_argument("--llama-draft", default=None, help="--spec: our draft as GGUF for llama.cpp's draft-simple "
                    "(python vendor/llama.cpp/convert_hf_to_gguf.py exactspec/assets/smollm2-draft --outfile F --outtype bf16)")
    ap.add_argument("--system-tokens", type=int, default=0, help="also a repeated system prompt of about this many "
                    "tokens, prefix reuse off / on (500 in the README)")
    ap.add_argument("--only-extra", action="store_true", help="skip the client-count table")
    a = ap.parse_args()
    model = default_model(a.model)
    if a.spec:
        spec_methods(a, model)
    if a.system_tokens:
        system_prompt(a, model)
    if a.only_extra:
        return
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
