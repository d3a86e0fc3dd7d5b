"""Every field of an answer but ids, timestamps and cache hits (text, logprobs, usage, finish
reason) is a function of the request alone: the same JSON from a server without a drafter and from
servers with each drafter, with their n-gram pool filled by other clients first, alone and
concurrently. The case that broke it: a stop string completed inside a verified draft, whose tokens
past the stop were counted in usage and listed in logprobs."""
import concurrent.futures as cf
import json

import httpx
import pytest

import exactspec
from exactspec.decode.drafters import LookupDrafter, NgramPool, PoolDrafter
from exactspec.serve.options import ServeOptions
from tests.serve.serving import InProcess


def post(url, body):
    r = httpx.post(url, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def canonical(r: httpx.Response) -> dict | list:
    """The answer without what may differ between servers: ids, timestamps, the prefix cache's hits;
    a stream as its events in order, each likewise."""
    def strip(d: dict) -> dict:
        d = {k: v for k, v in d.items() if k not in ("id", "created", "obfuscation")}
        if "usage" in d and d["usage"]:
            d["usage"] = {k: v for k, v in d["usage"].items() if k != "prompt_tokens_details"}
        return d
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [x[6:] for x in r.text.split("\n\n") if x.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return _joined([strip(json.loads(e)) for e in events[:-1]])
    return strip(r.json())


def _joined(events: list[dict]) -> dict:
    """A stream's events as one answer per choice (chunk boundaries are the drafter's: one verify step
    may bring several tokens): text, logprobs, finish reason, and the usage chunk."""
    out: dict = {"choices": {}, "usage": None}
    for e in events:
        if e.get("usage"):
            out["usage"] = e["usage"]
        for c in e["choices"]:
            got = out["choices"].setdefault(c["index"], {"text": "", "lp": [], "finish": None})
            got["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            lp = c.get("logprobs")
            if lp:
                got["lp"] += lp["content"] if "content" in lp else list(zip(lp["tokens"], lp["token_logprobs"]))
            got["finish"] = got["finish"] or c["finish_reason"]
    return out


@pytest.fixture(scope="module")
def answer(folder):
    """The no-drafter server's greedy answer to PROMPT, and stop strings that land at several places in it."""
    return exactspec.load(folder)


PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,"


def _stops(model) -> list[str]:
    """Stop strings that end inside a verified draft: the greedy answer (this model's: runs of '+'
    broken by ',') from its first change of character on, 2 to 6 characters long. A lookup mis-drafts
    that change, so the characters after it arrive in the next step's accepted draft."""
    text = model.generate(PROMPT, 40).text
    k = next(i for i in range(1, len(text)) if text[i] != text[i - 1])
    return [text[k:k + w] for w in (2, 3, 4, 6)]


def _bodies(model) -> list[tuple[str, dict]]:
    stops = _stops(model)
    assert stops
    bodies = []
    for stop in stops:
        for extra in ({}, {"logprobs": 2}, {"logprobs": 1, "echo": True}, {"n": 2, "temperature": 0.9, "seed": 3},
                      {"best_of": 3, "n": 2, "temperature": 1.0, "seed": 5, "logprobs": 0},
                      {"stream": True, "logprobs": 1, "stream_options": {"include_usage": True}},
                      {"stream": True, "n": 2, "temperature": 0.8, "seed": 7,
                       "stream_options": {"include_usage": True}}):
            bodies.append(("/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                               "stop": [stop], **extra}))
        for extra in ({"logprobs": True, "top_logprobs": 2}, {"stream": True, "logprobs": True,
                                                              "stream_options": {"include_usage": True}}):
            bodies.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                    "max_tokens": 40, "temperature": 0, "stop": stop, **extra}))
    return bodies


def _servers(folder):
    opts = ServeOptions(max_batch=4)
    yield "plain", InProcess(folder, opts)
    yield "lookup k=8", InProcess(folder, opts, drafter=LookupDrafter(), num_draft_tokens=8)
    yield "lookup auto", InProcess(folder, opts, drafter=LookupDrafter(), num_draft_tokens="auto")
    yield "pool", InProcess(folder, opts, drafter=PoolDrafter(NgramPool()), num_draft_tokens=6)


@pytest.mark.slow
def test_the_whole_answer_is_the_same_with_every_drafter_alone_and_concurrently(folder, answer):
    bodies = _bodies(answer)
    want = None
    for name, s in _servers(folder):
        s.gate.open.set()
        try:
            if name == "pool":  # other clients' text in its pool first: it drafts from their tokens too
                for _, b in bodies[:6]:
                    post(s.url + "/v1/completions", {**b, "stop": None, "max_tokens": 40})
            alone = [canonical(post(s.url + path, b)) for path, b in bodies]
            with cf.ThreadPoolExecutor(6) as ex:
                together = list(ex.map(lambda pb: canonical(post(s.url + pb[0], pb[1])), bodies))
        finally:
            s.stop()
        if want is None:
            want = alone
        for i, (got, both) in enumerate(zip(alone, together)):
            assert got == want[i], (name, bodies[i])
            assert both == want[i], (name, "concurrent", bodies[i])


def test_a_stop_inside_a_verified_draft_cuts_logprobs_and_usage_there(folder, answer):
    """The smallest case, in the fast set: lookup drafts of 8 on a repeating prompt, logprobs on."""
    stop = _stops(answer)[1]
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": [stop], "logprobs": 1}
    out = []
    for kw in ({}, {"drafter": LookupDrafter(), "num_draft_tokens": 8}):
        s = InProcess(folder, ServeOptions(max_batch=2), **kw)
        s.gate.open.set()
        try:
            out.append(canonical(post(s.url + "/v1/completions", body)))
        finally:
            s.stop()
    plain, drafted = out
    assert plain["choices"][0]["finish_reason"] == "stop"
    n = plain["usage"]["completion_tokens"]
    assert len(plain["choices"][0]["logprobs"]["tokens"]) == n < 40
    assert drafted == plain


def _receipts(r: httpx.Response) -> list[dict]:
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        return [e["receipt"] for e in events if "receipt" in e]
    return [r.json()["receipt"]]


@pytest.mark.slow
def test_receipts_from_servers_under_load_verify_and_a_tampered_one_fails_where_tampered(folder, answer):
    """Receipts asked of servers with each drafter by 6 clients at once (stop strings inside verified
    drafts, n = 2, sampling, streams) replay to the same tokens by plain decoding, alone."""
    from exactspec import receipt
    bodies = [b for b in _bodies(answer) if b[0] == "/v1/chat/completions" or "best_of" not in b[1]][:12]
    got = []
    for name, s in _servers(folder):
        s.gate.open.set()
        try:
            with cf.ThreadPoolExecutor(6) as ex:
                rs = list(ex.map(lambda pb: post(s.url + pb[0], {**pb[1], "receipt": True}), bodies))
        finally:
            s.stop()
        for (path, b), r in zip(bodies, rs):
            (rec,) = _receipts(r)
            assert len(rec["choices"]) == b.get("n", 1)
            v = receipt.verify(answer, rec)
            assert v.identical, (name, b, v.problems)
            got.append(rec)
    want = got[: len(bodies)]  # every server gave the same receipts (the same answers)
    for i, rec in enumerate(got):
        assert rec["choices"] == want[i % len(bodies)]["choices"]
    bad = json.loads(json.dumps(got[0]))
    ids = bad["choices"][0]["token_ids"]
    ids[len(ids) // 2] = (ids[len(ids) // 2] + 1) % answer.cfg.vocab_size
    assert receipt.verify(answer, bad).first_difference[0] == len(ids) // 2


@pytest.mark.slow
def test_the_probes_reproductions_on_smollm2(smollm2):
    """Issue 40's two reproductions on the real file: with a stop string and logprobs, 28 tokens without
    a draft but 40 with lookup or head+pool; 29, then 30, on a rerun with head+pool (the pool's history)."""
    bodies = [{"prompt": "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 1, 2, 3, 4, 5, 6,",
               "max_tokens": 40, "temperature": 0, "stop": [" 14"], "logprobs": 1},
              {"prompt": "Hello world, this is", "max_tokens": 48, "temperature": 0, "stop": ["\n\n"], "logprobs": 1},
              {"messages": [{"role": "user", "content": "Count from 1 to 30, separated by commas."}],
               "max_tokens": 60, "temperature": 0, "stop": [" 17"], "logprobs": True, "top_logprobs": 1}]
    model = exactspec.load(smollm2)
    got = {}
    for name in (None, "head+pool"):  # (lookup is in the matrix above, on the tiny model)
        kw = {} if name is None else {"drafter": model.make_drafter(name), "num_draft_tokens": "auto"}
        s = InProcess(smollm2, ServeOptions(max_batch=4), model=model, **kw)
        s.gate.open.set()
        try:
            for rerun in range(1 if name is None else 2):
                for i, b in enumerate(bodies):
                    path = "/v1/chat/completions" if "messages" in b else "/v1/completions"
                    got[(name, rerun, i)] = canonical(post(s.url + path, b))
        finally:
            s.stop()
            model.net = s.gate.net
    for key, answer in got.items():
        assert answer == got[(None, 0, key[2])], key
    assert got[(None, 0, 0)]["usage"]["completion_tokens"] < 40 and got[(None, 0, 0)]["choices"][0]["finish_reason"] == "stop"
