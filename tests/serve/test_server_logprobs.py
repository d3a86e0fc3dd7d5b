"""Logprobs through the server, with the official openai client: generated under speculative
decoding and concurrency, then the prompt + generated tokens scored with echo and max_tokens 0:
every token's logprob is the same float (JSON floats round-trip exactly). n, best_of, chat."""
import concurrent.futures as cf
import math
import time

import httpx
import pytest

from exactspec.decode.drafters import LookupDrafter
from exactspec.serve.options import ServeOptions
from tests.serve.serving import InProcess, openai_client


@pytest.fixture(scope="module")
def srv(folder):
    s = InProcess(folder, ServeOptions(max_batch=4), drafter=LookupDrafter(), num_draft_tokens=3)
    s.gate.open.set()
    yield s
    s.stop()


def client(s):
    return openai_client(s)


PROMPTS = [("def add(a, b):", 0.0, 1), ("The quick brown", 0.8, 2), ("for path in", 1.1, 3), ("class Stack:", 0.0, 4)]


def test_generated_logprobs_equal_the_scored_ones(srv):
    c = client(srv)
    model = srv.model

    def gen(i):
        p, t, sd = PROMPTS[i]
        return c.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=t, seed=sd, logprobs=3)
    with cf.ThreadPoolExecutor(4) as ex:  # concurrent, speculative (prompt lookup), batched
        outs = list(ex.map(gen, range(len(PROMPTS))))
    for (p, t, sd), r in zip(PROMPTS, outs):
        lp = r.choices[0].logprobs
        want = model.generate(p, 24, temperature=t, seed=sd, logprobs=3)
        assert lp.token_logprobs == [x.logprob for x in want.logprobs]  # the library's floats, exactly
        # top_logprobs is OpenAI's {token text: logprob}: ids that decode alike share a key
        assert [max(d.values()) for d in lp.top_logprobs] == [x.top[0][1] for x in want.logprobs]
        assert len(lp.tokens) == len(want.token_ids) == r.usage.completion_tokens
        ids = model.encode(p) + want.token_ids  # score prompt + completion as ids: no re-tokenizing
        s = c.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
        slp = s.choices[0].logprobs
        assert slp.token_logprobs[0] is None and len(slp.token_logprobs) == len(ids)
        assert slp.token_logprobs[len(ids) - len(want.token_ids):] == lp.token_logprobs  # bitwise
        assert s.usage.completion_tokens == 0


def test_streamed_logprobs_equal_the_whole_ones(srv):
    c = client(srv)
    kw = dict(model="tiny", prompt="import os", max_tokens=20, temperature=0.7, seed=9, logprobs=2)
    whole = c.completions.create(**kw).choices[0].logprobs.token_logprobs
    streamed = []
    for ch in c.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs:
            streamed += ch.choices[0].logprobs.token_logprobs
    assert streamed == whole


def test_echo_with_generation_and_n_and_best_of(srv):
    c = client(srv)
    r = c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=8, temperature=0.9, seed=5, n=3,
                             echo=True, logprobs=1)
    assert len(r.choices) == 3 and all(ch.text.startswith("def add(a, b):") for ch in r.choices)
    one = [c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=8, temperature=0.9, seed=5 + i)
           .choices[0].text for i in range(3)]
    assert [ch.text[len("def add(a, b):"):] for ch in r.choices] == one  # choice i = seed + i, reproducible
    b = c.completions.create(model="tiny", prompt="x = [", max_tokens=8, temperature=1.0, seed=3, n=1, best_of=4)
    cands = [model_gen(srv, "x = [", 3 + i) for i in range(4)]
    best = max(cands, key=lambda g: (sum(x.logprob for x in g.logprobs) / len(g.logprobs)))
    assert b.choices[0].text == best.text


def model_gen(srv, prompt, seed):
    return srv.model.generate(prompt, 8, temperature=1.0, seed=seed, logprobs=0)


def test_chat_logprobs_shape(srv):
    c = client(srv)
    msgs = [{"role": "user", "content": "class Stack:"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                  top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(x.top_logprobs) == 2 for x in content)
    assert all(math.isfinite(x.logprob) and x.logprob <= 0 for x in content)
    assert all(bytes(x.bytes).decode("utf-8", "replace") == x.token for x in content)
    bad = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                     json={"messages": msgs, "top_logprobs": 2, "max_tokens": 2})
    assert bad.status_code == 400 and "top_logprobs needs logprobs=true" in bad.json()["error"]["message"]


def test_n_choices_stream_interleaved_and_equal_the_whole_ones(srv):
    c = client(srv)
    kw = dict(model="tiny", prompt="for path in", max_tokens=16, temperature=1.0, seed=11, n=3, logprobs=1)
    whole = c.completions.create(**kw)
    texts, lps, finishes = ["", "", ""], [[], [], []], [None] * 3
    for ch in c.completions.create(stream=True, **kw):
        for x in ch.choices:
            texts[x.index] += x.text
            lps[x.index] += x.logprobs.token_logprobs if x.logprobs else []
            finishes[x.index] = x.finish_reason or finishes[x.index]
    assert texts == [x.text for x in whole.choices] and all(finishes)
    assert lps == [x.logprobs.token_logprobs for x in whole.choices]


def test_echo_scoring_is_chunked_so_a_short_request_waits_one_chunk(folder, model):
    """A long echo (max_tokens 0, logprobs) is scored in prefill_chunk-row forwards, each between two
    engine steps: a short request sent after it finishes while the scoring still has chunks to go
    (one forward held the engine for the whole prompt: 110 s for a 3-token chat on the Gemma file).
    The gate hands out one forward at a time; the floats are score()'s."""
    ids = [int(t) for t in (list(range(3, 200)) * 2)[:300]]
    s = InProcess(folder, ServeOptions(prefill_chunk=16))
    done: list[str] = []

    def post(name: str, body: dict) -> dict:
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=300)
        done.append(name)
        return r.json()
    try:
        with cf.ThreadPoolExecutor(2) as ex:
            scoring = ex.submit(post, "score", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})
            deadline = time.time() + 120
            while not s.gate.waiting and time.time() < deadline:  # its first chunk waits at the gate
                time.sleep(0.01)
            short = ex.submit(post, "short", {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True})
            while not (scoring.done() and short.done()):
                assert time.time() < deadline + 180, "the engine stalled"
                if s.gate.idle:
                    s.gate.step()
                time.sleep(0.01)
        assert done == ["short", "score"]  # 300 rows in 16-row chunks: ~19 forwards; the short one needs ~4
        assert s.gate.used >= 300 // 16
        got = scoring.result()["choices"][0]["logprobs"]["token_logprobs"][1:]
        want = [x.logprob for x in model.score(ids[:1], ids[1:])]
        assert got == want
    finally:
        s.stop()
