"""Structured output: JSON extraction under 20+ schemas (nested objects, bounded arrays, enums, ranged
numbers, optional fields, string patterns) and forced tool calls, on one model, one run: plain
constrained decoding (no drafts, k = 0) beside forced text as drafts, lookups, the head, a prediction.

    python bench/structured.py [--model PATH] [--max-new-tokens 160] [--repeat 3]
    python bench/structured.py --llama-server PATH [--model PATH]   # servers side by side, see `servers`

Prints per method: tokens/s (median over repeats, end to end) and its ratio to plain constrained
decoding, tokens per target forward, whether every answer's token ids equal plain constrained
decoding's (they must), and how many answers parse and validate against their schema (jsonschema). Then
the matcher's share of a step: the time in llguidance's mask and forced-token calls over the wall time.
The default model is the demo's SmolLM2-135M-Instruct Q4_1 file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import exactspec
from exactspec.decode import constraint as C
from exactspec.text import chat
from common import default_model, table

PERSON = "Maria Lopez, 34, is a nurse from Valencia, Spain. Email: maria.lopez@example.com. Speaks Spanish and English."
ORDER = "Order #4471 by Tom Berger: 12 blue mugs at 4.50 EUR each and 2 teapots at 19.90 EUR each, shipped by post."
EVENT = "The Python meetup on 2026-03-14 at 18:30 in Room B of the city library; 40 seats, free entry, talks on typing."
MOVIE = "Arrival (2016), directed by Denis Villeneuve, science fiction, 116 minutes, rated 7.9 of 10."
TEXTS = [PERSON, ORDER, EVENT, MOVIE]
STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [  # (the text it extracts from, the schema)
    (PERSON, obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    (PERSON, obj({"name": STR, "job": STR, "city": STR, "country": STR})),
    (PERSON, obj({"email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,4}$"}, "name": STR})),
    (PERSON, obj({"languages": {"type": "array", "items": {"enum": ["Spanish", "English", "French", "German"]},
                                "minItems": 1, "maxItems": 4}})),
    (PERSON, obj({"person": obj({"first": STR, "last": STR}), "age": INT})),
    (PERSON, obj({"name": STR, "nickname": STR, "age": INT}, ["name", "age"])),
    (ORDER, obj({"order": {"type": "integer", "minimum": 1, "maximum": 99999}, "customer": STR})),
    (ORDER, obj({"items": {"type": "array", "maxItems": 4, "items": obj({"what": STR, "count": INT,
                                                                          "price": NUM})}})),
    (ORDER, obj({"currency": {"enum": ["EUR", "USD", "GBP"]}, "shipping": {"enum": ["post", "courier", "pickup"]}})),
    (ORDER, obj({"total": {"type": "number", "minimum": 0, "maximum": 10000}, "paid": BOOL}, ["total"])),
    (ORDER, obj({"customer": obj({"name": STR}), "lines": {"type": "integer", "minimum": 1, "maximum": 10}})),
    (EVENT, obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                 "time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"}})),
    (EVENT, obj({"title": STR, "seats": {"type": "integer", "minimum": 1, "maximum": 1000}, "free": BOOL})),
    (EVENT, obj({"where": obj({"room": STR, "building": STR}), "topics": {"type": "array", "items": STR,
                                                                         "maxItems": 3}})),
    (EVENT, obj({"kind": {"enum": ["meetup", "conference", "workshop"]}, "language": STR})),
    (MOVIE, obj({"title": STR, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}})),
    (MOVIE, obj({"director": STR, "genre": {"enum": ["drama", "comedy", "science fiction", "horror"]}})),
    (MOVIE, obj({"minutes": {"type": "integer", "minimum": 1, "maximum": 400},
                 "rating": {"type": "number", "minimum": 0, "maximum": 10}})),
    (MOVIE, obj({"movie": obj({"title": STR, "year": INT, "director": STR})})),
    (MOVIE, obj({"title": STR, "sequel": BOOL, "awards": {"type": "array", "items": STR, "maxItems": 2}},
                ["title", "sequel"])),
    (PERSON, obj({"contact": obj({"email": STR, "phone": STR}, ["email"]), "name": STR})),
    (ORDER, obj({"items": {"type": "array", "items": {"enum": ["mug", "teapot", "plate"]}, "minItems": 1,
                           "maxItems": 3}, "count": INT})),
]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": obj(
    {"city": STR, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}})}}


def servers(a) -> None:
    """`exactspec serve` vs llama.cpp's `llama-server` on the same file, the same 22 chat requests with
    `response_format: json_schema`, one client, greedy, non-streamed, one server at a time: completion
    tokens/s (each side's usage over the wall time of its requests), valid answers, and for each side
    whether its speculative setting changed any answer of its plain one (llama-server: its ngram-mod
    speculation; ours: forced text + head + lookup vs k=0)."""
    import httpx
    from common import serving
    from serve_vs_llamacpp import llama_server
    model = default_model(a.model)
    msgs = [[{"role": "user", "content": f"Extract the facts of this text as JSON.\n\n{t}"}] for t, _ in SCHEMAS]

    def run(url: str) -> dict:
        def one(m, s):
            body = {"model": "m", "messages": m, "max_tokens": a.max_new_tokens, "temperature": 0.0,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()
            return r["choices"][0]["message"]["content"] or "", r["usage"]["completion_tokens"]
        one(msgs[0], SCHEMAS[0][1])  # warm-up
        t0 = time.perf_counter()
        got = [one(m, s) for m, (_, s) in zip(msgs, SCHEMAS)]
        return {"wall": time.perf_counter() - t0, "texts": [g[0] for g in got], "tokens": sum(g[1] for g in got)}
    # one server at a time: numba's OpenMP pool spins between calls (OMP_WAIT_POLICY=PASSIVE, which
    # serve_vs_llamacpp.py sets where servers sit idle beside each other, cost 35% here: measured)
    sides = [("exactspec", "plain constrained (k=0)", lambda: serving("--model", model, "--max-batch", "1",
                                                                      "--num-draft-tokens", "0")),
             ("exactspec", "forced + head+lookup", lambda: serving("--model", model, "--max-batch", "1", "--draft",
                                                                   "head+lookup")),
             ("llama-server", "greedy", lambda: llama_server(a.llama_server, model, 1, 2)),
             ("llama-server", "ngram-mod", lambda: llama_server(a.llama_server, model, 1, 2,
                                                                extra=["--spec-type", "ngram-mod"]))]
    runs: dict[tuple[str, str], list[dict]] = {(s, n): [] for s, n, _ in sides}
    for _ in range(a.repeat):  # alternated, so a slow spell of the machine hits every side
        for side, name, start in sides:
            with start() as url:
                runs[side, name].append(run(url))
    rows, base = [], {}
    peer = statistics.median(r["tokens"] / r["wall"] for r in runs["llama-server", "greedy"])
    for (side, name), rs in runs.items():
        tps = statistics.median(r["tokens"] / r["wall"] for r in rs)
        texts = rs[0]["texts"]
        base.setdefault(side, texts)
        valid = 0
        for t, (_, s) in zip(texts, SCHEMAS):
            try:
                import jsonschema
                jsonschema.validate(json.loads(t), s)
                valid += 1
            except Exception:
                pass
        same = sum(x == y for x, y in zip(texts, base[side]))
        stable = all(r["texts"] == texts for r in rs)
        rows.append([side, name, f"{tps:.1f}", f"{tps / peer:.2f}x", f"{valid}/{len(SCHEMAS)}",
                     f"{same}/{len(SCHEMAS)}", "yes" if stable else "no"])
    table(["server", "setting", "completion tok/s", "vs llama-server greedy", "valid JSON", "texts = its plain",
           "same texts every repeat"], rows, f"{len(SCHEMAS)} json_schema chats, 1 client, median of {a.repeat}, "
          f"{model}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary: servers side by side instead")
    a = ap.parse_args()
    if a.llama_server:
        return servers(a)
    m = exactspec.load(default_model(a.model))
    cfg = m.tokenizer.config
    prompts = [chat.render(cfg, [{"role": "user", "content": f"Extract the facts of this text as JSON.\n\n{t}"}])
               for t, _ in SCHEMAS]
    # forced tool calls, as the server constrains them (tool_choice "required")
    from exactspec.serve.protocol import ChatRequest
    from exactspec.serve import tools
    r = ChatRequest(messages=[{"role": "user", "content": "What is the weather in Oslo for 3 days?"}], tools=[TOOL],
                    tool_choice="required", parallel_tool_calls=False)
    tp = tools.plan(r)
    msgs, offered = tools.messages(r, tp, chat.template_source(cfg) or "")
    tool_prompt, tool_grammar = chat.render(cfg, msgs, tools=offered), tools.constraint(m, r, tp)
    m.generate(prompts[0], 8, json_schema=SCHEMAS[0][1], draft="lookup")  # compile; measure the verify costs
    methods = [("plain constrained (k=0)", {"num_draft_tokens": 0}), ("forced text (auto)", {}),
               ("forced + lookup", {"draft": "lookup"}), ("forced + head", {"draft": "head"}),
               ("forced + head+lookup", {"draft": "head+lookup"})]
    rows, base = [], None
    spent = {"t": 0.0}
    for name, f in (("mask", "mask"), ("draft", "draft")):
        real = getattr(C.Matcher, f)

        def timed(self, *args, _real=real):
            t = time.perf_counter()
            try:
                return _real(self, *args)
            finally:
                spent["t"] += time.perf_counter() - t
        setattr(C.Matcher, f, timed)
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    for name, kw in methods:
        speeds, res, share = [], None, []
        for _ in range(a.repeat):
            spent["t"] = 0.0
            t = time.perf_counter()
            res = [m.generate(p, a.max_new_tokens, json_schema=s, **kw) for p, (_, s) in zip(prompts, SCHEMAS)]
            res.append(m.generate(tool_prompt, a.max_new_tokens, grammar=tool_grammar.source, **kw))
            wall = time.perf_counter() - t
            speeds.append(sum(len(x.token_ids) for x in res) / wall)
            share.append(spent["t"] / wall)
        ids = [x.token_ids for x in res]
        base = base or (statistics.median(speeds), ids)
        valid = 0
        for x, (_, s) in zip(res, SCHEMAS):
            try:
                obj_ = json.loads(x.text)
                if jsonschema is not None:
                    jsonschema.validate(obj_, s)
                valid += x.finish_reason == "stop"
            except Exception:
                pass
        call = tools.calls(res[-1].text, tp)[1]
        toks, fwd = sum(len(x.token_ids) for x in res), sum(x.stats.forward_passes for x in res)
        tps = statistics.median(speeds)
        rows.append([name, f"{tps:.1f}", f"{tps / base[0]:.2f}x", f"{toks / fwd:.2f}", ids == base[1],
                     f"{valid}/{len(SCHEMAS)}", "yes" if len(call) == 1 else "no", f"{100 * statistics.median(share):.1f}%"])
    table(["method", "tok/s", "vs plain constrained", "tokens/forward", "same ids", "valid JSON", "tool call parses",
           "matcher's share of the wall"], rows, f"{len(SCHEMAS)} schemas + a forced tool call, {m.folder.name}")


if __name__ == "__main__":
    main()
