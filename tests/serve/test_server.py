"""The real server on a loopback port, driven by the official `openai` client and raw HTTP."""
import concurrent.futures as cf
import json
import time

import httpx
import pytest

from exactspec.text import chat
from exactspec.serve.options import ServeOptions
from tests.serve.serving import InProcess, Running

pytestmark = pytest.mark.slow  # `exactspec serve` in a subprocess


@pytest.fixture(scope="module")
def server(folder):
    s = Running(folder, "--draft", "lookup", "--num-draft-tokens", "3", "--max-batch", "4")
    yield s
    s.stop()


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_completion_equals_library_generate(server, model):
    r = server.client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=40, temperature=0)
    want = model.generate("def fibonacci(n):", 40)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == len(model.encode("def fibonacci(n):"))
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")


def test_streaming_equals_non_streaming_with_seed(server):
    kw = dict(model="tiny", prompt="import os", max_tokens=50, temperature=0.9, top_p=0.95, seed=17)
    whole = server.client.completions.create(**kw).choices[0].text
    chunks = list(server.client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    other = server.client.completions.create(**{**kw, "seed": 18}).choices[0].text
    assert other != whole


def test_chat_template_and_chat_streaming(server, model):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "class Stack:"}]
    r = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=0)
    text = chat.render(model.tokenizer.config, msgs)
    assert text.endswith("<|assistant|>\n")
    want = model.generate(model.tokenizer.encode(text, add_special_tokens=False), 30)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    stream = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_stop_strings(server, model):
    full = model.generate("def fibonacci(n):", 60).text
    stop = full[10:13]
    cut = full[: full.index(stop)]
    r = server.client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=60, temperature=0,
                                         stop=[stop, "zzzz-never"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    s = server.client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=60, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in s) == cut


def test_concurrent_requests_equal_each_alone(server, model):
    prompts = [("def add(a, b):", 0.0, 1), ("The quick brown", 0.8, 2), ("for path in", 1.1, 3),
               ("class Stack:", 0.0, 4), ("import sys", 0.7, 5), ("x = [", 0.0, 6), ("print(", 1.0, 7),
               ("if __name__", 0.5, 8)]
    want = [model.generate(p, 40, temperature=t, seed=s).text for p, t, s in prompts]

    def one(i):
        p, t, s = prompts[i]
        if i % 2:
            return "".join(c.choices[0].text for c in server.client.completions.create(
                model="tiny", prompt=p, max_tokens=40, temperature=t, seed=s, stream=True))
        return server.client.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=t,
                                                seed=s).choices[0].text
    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(one, range(len(prompts))))
    assert got == want


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "x", "max_tokens": 100000}).encode(), 400, "maximum context length"),
    (json.dumps({"prompt": "x " * 1100}).encode(), 400, "maximum context length"),
    (json.dumps({"prompt": ""}).encode(), 400, "empty"),
    (json.dumps({"prompt": [1, 99999]}).encode(), 400, "outside the vocabulary"),
    (json.dumps({"prompt": "x", "n": 9}).encode(), 400, "n <= best_of <= 8"),
    (json.dumps({"prompt": "x", "n": 2, "best_of": 3, "stream": True}).encode(), 400, "best_of > n cannot stream"),
    (json.dumps({"prompt": "x", "logprobs": 21}).encode(), 400, "at most 20"),
    (json.dumps({"prompt": "x", "model": "/etc/passwd"}).encode(), 404, "does not exist"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "x", "suffix": "y"}).encode(), 400, "suffix='y' is not supported"),
    (json.dumps({"prompt": "x", "presence_penalty": 0.5}).encode(), 400, "presence_penalty"),
])
def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, body, status, needle):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_informational_fields_and_defaults_of_unsupported_ones_are_accepted(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "user": "me",
                                                         "logprobs": None, "echo": False, "frequency_penalty": 0},
                   timeout=120)
    assert r.status_code == 200, r.text


def test_bad_chat_requests(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"content": "hi"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_metrics_are_prometheus_text(server):
    server.client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("exactspec_requests_total", "exactspec_generated_tokens_total", "exactspec_acceptance_rate",
                 "exactspec_time_to_first_token_seconds_bucket", "exactspec_request_latency_seconds_count",
                 "exactspec_running_sequences"):
        assert name in text, name


def test_disconnect_frees_the_slot_and_full_queue_answers_429(folder):
    s = InProcess(folder, ServeOptions(max_batch=1, max_queue=1))
    eng = s.srv.engine
    try:
        for _ in range(8):  # enough steps for a first chunk (a token may be part of a UTF-8 character, held back)
            s.gate.step()
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120,  # a cold numba cache compiles first
                          json={"prompt": "a", "max_tokens": 1000, "stream": True, "ignore_eos": True,
                                "temperature": 0}) as r:
            for _ in r.iter_lines():
                break  # one chunk, then hang up mid-stream
        # the server sees the hang-up at a send after it: hand out steps one at a time until it has
        # (each only when the last is used: a step may first compile a kernel for seconds)
        deadline = time.time() + 120
        while not (eng.stats.cancelled == 1 or (eng.active and eng.active[0].cancelled)):  # marked, or gone
            assert time.time() < deadline, "the disconnected request was not cancelled"
            if s.gate.idle:
                s.gate.step()
            time.sleep(0.01)
        assert s.gate.given < 100  # far from the request's 1000 tokens: it was cancelled, not finished
        s.gate.open.set()
        s.until("the slot freed", lambda: eng.running == 0)
        assert eng.stats.cancelled == 1 and 0 < eng.stats.cancelled_tokens < 1000
        assert "exactspec_cancelled_requests 1.0" in httpx.get(s.url + "/metrics").text
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "b", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200
        # one request running (its prefill held at the gate), one queued: the third gets 429
        s.gate.open.clear()
        body = {"prompt": "c", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        with cf.ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=120)]
            s.until("running=1, queued=0", lambda: (eng.running, eng.queued) == (1, 0))
            futs.append(ex.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=120))
            s.until("running=1, queued=1", lambda: (eng.running, eng.queued) == (1, 1))
            third = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert third.status_code == 429 and third.json()["error"]["type"] == "rate_limit_error"
            assert third.headers["retry-after"] == "1"
            s.gate.open.set()
            done = [f.result() for f in futs]
        assert [d.status_code for d in done] == [200, 200]
        assert [d.json()["usage"]["completion_tokens"] for d in done] == [20, 20]
        assert done[0].json()["choices"][0]["text"] == done[1].json()["choices"][0]["text"]
    finally:
        s.stop()


def test_sigterm_during_8_streams_ends_each_cleanly(folder):
    """`kill -TERM` on `exactspec serve` while 8 streams run: each ends with [DONE] after a finish
    reason or an error event (none cut short), the process exits, and its log has no traceback."""
    import signal
    import threading
    s = Running(folder, "--max-batch", "8", "--shutdown-grace", "1")
    started = threading.Barrier(9)

    def one(i):
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120,
                          json={"prompt": f"def f{i}(x):", "max_tokens": 900, "stream": True, "temperature": 0,
                                "ignore_eos": True}) as r:
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 1:
                        started.wait(60)
            return lines
    try:
        with cf.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(one, i) for i in range(8)]
            started.wait(120)  # every stream has its first chunk
            s.proc.send_signal(signal.SIGTERM)
            for f in futs:
                lines = f.result(timeout=60)
                assert lines[-1] == "data: [DONE]", lines[-3:]
                last = json.loads(lines[-2][6:])
                ended = "error" in last or last["choices"][0]["finish_reason"] is not None
                assert ended, lines[-3:]
        # uvicorn re-raises the captured signal once it has shut down: the exit is SIGTERM's own
        assert s.proc.wait(timeout=30) in (0, -signal.SIGTERM)
        log = s.proc.stdout.read()
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    finally:
        s.stop()
