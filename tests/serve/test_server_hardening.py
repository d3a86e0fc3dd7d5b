"""The server against hostile or unlucky clients: auth, limits, faults, a dead engine, slow and
vanished clients. Real uvicorn on 127.0.0.1 (configured as `exactspec serve` does), the official
`openai` client and raw HTTP; the target is gated so the test decides when the engine steps."""
import concurrent.futures as cf
import json
import shutil
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

import exactspec
from exactspec.serve.options import ServeOptions
from tests.serve.serving import openai_client



def post(url, **kw):  # generous: the first request after a kernel edit compiles for seconds
    return httpx.post(url, **{"timeout": 120, **kw})


def get(url, **kw):
    return httpx.get(url, **{"timeout": 120, **kw})


def client(s, key="none"):
    return openai_client(s, key)


def test_api_key_guards_v1_and_optionally_health_and_metrics(serve):
    s = serve(ServeOptions(api_key="sekret"))
    r = post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = get(s.url + "/v1/models", headers={"Authorization": "Bearer sekreT"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(s, "wrong").completions.create(model="tiny", prompt="a", max_tokens=2)
    ok = client(s, "sekret").completions.create(model="tiny", prompt="a", max_tokens=2, temperature=0,
                                                extra_body={"ignore_eos": True})  # 2 tokens, whatever the model
    assert ok.usage.completion_tokens == 2
    assert get(s.url + "/health").status_code == 200 and get(s.url + "/metrics").status_code == 200
    p = serve(ServeOptions(api_key="sekret", protect_metrics=True))
    assert get(p.url + "/health").status_code == 401 and get(p.url + "/metrics").status_code == 401
    assert get(p.url + "/health", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_body_limit_413_by_length_and_by_counting(serve):
    s = serve(ServeOptions(max_body_bytes=2000))
    r = post(s.url + "/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 2})
    assert r.status_code == 413 and "exceeds 2000 bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the middleware counts
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'", "max_tokens": 2}'
    r = post(s.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_20_mb_body_gets_its_413_not_a_connection_reset(serve):
    """Issue 27's probe saw "connection reset" for a 20 MB body. With uvicorn 0.55 (the pin) the 413
    reaches both a fast client and one still sending after the answer (this passes without any
    change here): kept as the guard for that row of the table."""
    s = serve()  # 1 MiB limit
    body = b'{"prompt": "' + b"x" * (20 << 20) + b'", "max_tokens": 2}'
    r = post(s.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds 1048576 bytes" in r.json()["error"]["message"]
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:  # a client that sends slowly
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(0.3)  # the server has the headers; it may answer now, but must not close yet
        for i in range(0, len(body), 1 << 20):
            c.sendall(body[i: i + (1 << 20)])  # a reset here is the bug
        reply = b""
        while b"}}" not in reply:
            got = c.recv(65536)
            assert got, reply
            reply += got
    assert reply.startswith(b"HTTP/1.1 413") and b"exceeds 1048576 bytes" in reply


def test_health_answers_while_a_request_is_being_tokenized(serve, folder):
    model = exactspec.load(folder)
    release, inside = threading.Event(), threading.Event()
    encode = model.tokenizer.encode

    def slow_encode(*a, **kw):  # a huge prompt's tokenizing, held as long as the test likes
        inside.set()
        assert release.wait(30)
        return encode(*a, **kw)
    model.tokenizer.encode = slow_encode
    s = serve(model=model)
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(httpx.post, s.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}, timeout=120)
        assert inside.wait(30)
        t = time.perf_counter()
        h = get(s.url + "/health", timeout=5)  # on the event loop, while encode holds a worker thread
        assert h.status_code == 200 and time.perf_counter() - t < 2
        release.set()
        assert fut.result().status_code == 200


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "a", "stop": [f"s{i}" for i in range(17)]}, "17 stop strings; at most 16"),
    ({"prompt": "a", "stop": "z" * 300}, "longer than 256 characters"),
])
def test_stop_string_limits(serve, body, needle):
    s = serve()
    r = post(s.url + "/v1/completions", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"] and r.json()["error"]["param"] == "stop"


@pytest.mark.parametrize("content,status,needle", [
    ([{"type": "text", "text": 5}], 400, "messages.0.content.0.text"),
    ([{"type": "text", "text": None}], 400, "needs a string 'text'"),
    ([{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "hi"}], 400,
     "'image_url' are not supported"),  # refused, never silently dropped
    ([{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}], 200, None),
])
def test_chat_content_parts(serve, content, status, needle):
    s = serve()
    r = post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                         "max_tokens": 2})
    assert r.status_code == status, r.text
    if needle:
        assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize("template,status,needle", [
    ("{{ raise_exception('roles must alternate') }}", 400, "roles must alternate"),
    ("{{ messages[0]['content'] * 100000000 }}", 400, "would build"),
    ("{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}", 400, "exceeds"),
    ("{{ messages[0]['content'] + 1 }}", 400, "cannot render"),
    ("{% for %}", 500, "does not compile"),
    # issue 40: nested loops that would render for hours: stopped by the step budget (a few seconds)
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", 400, "budget of steps"),
])
def test_chat_template_failures_say_whose_fault(serve, folder, tmp_path, template, status, needle):
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    s = serve(ServeOptions(max_prompt_chars=100_000), model=exactspec.load(d))
    r = post(s.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 2})
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == ("server_error" if status == 500 else "invalid_request_error")
    assert get(s.url + "/health").status_code == 200


PROMPTS = [("def add(a, b):", 0.0, 1), ("The quick brown", 0.8, 2), ("for path in", 1.1, 3), ("class Stack:", 0.0, 4),
           ("import sys", 0.7, 5), ("x = [", 0.0, 6)]


def test_a_fault_in_one_request_fails_it_alone(serve, model):
    """One request raises inside the engine (after 2 tokens: the test's wrapper of the target fails
    every forward that holds a row of it); the others, streaming or not, run beside it and give
    exactly their solo tokens; the faulty one gets a 500 (or, streaming, an error event then
    [DONE]) with an error id, and the server keeps serving."""
    s = serve(ServeOptions(max_batch=4))
    s.gate.faulty |= {tuple(model.encode("BOOM here")), tuple(model.encode("BOOM there"))}
    want = [model.generate(p, 30, temperature=t, seed=sd).text for p, t, sd in PROMPTS]
    c = client(s)

    def one(i):
        p, t, sd = PROMPTS[i]
        if i % 2:
            return "".join(ch.choices[0].text for ch in c.completions.create(
                model="tiny", prompt=p, max_tokens=30, temperature=t, seed=sd, stream=True))
        return c.completions.create(model="tiny", prompt=p, max_tokens=30, temperature=t, seed=sd).choices[0].text

    def faulty():
        return post(s.url + "/v1/completions", json={"prompt": "BOOM here", "max_tokens": 30, "temperature": 0})

    def faulty_stream():
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120,
                          json={"prompt": "BOOM there", "max_tokens": 30, "stream": True, "temperature": 0}) as r:
            return r.status_code, [line for line in r.iter_lines() if line]
    with cf.ThreadPoolExecutor(8) as ex:
        bad = ex.submit(faulty)
        bad_stream = ex.submit(faulty_stream)
        got = list(ex.map(one, range(len(PROMPTS))))
    assert got == want
    r = bad.result()
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "internal error while decoding (id " in r.json()["error"]["message"]
    status, lines = bad_stream.result()
    assert status == 200 and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "error" in events[-1] and "internal error while decoding" in events[-1]["error"]["message"]
    assert any(e.get("choices") for e in events[:-1])  # tokens came before the failure
    assert s.srv.engine.stats.failed == 2 and s.srv.engine.alive
    assert "exactspec_failed_requests 2.0" in get(s.url + "/metrics").text
    assert c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=30, temperature=0).choices[0].text \
        == want[0]


class Die(BaseException):
    """Not an Exception: nothing in the engine loop catches it, so the engine thread dies."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the point of the test
def test_a_dead_engine_gives_503_never_a_hang(serve):
    s = serve(gate="closed")
    eng = s.srv.engine
    s.gate.open.clear()
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(httpx.post, s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 5}, timeout=120)
        s.until("the request running", lambda: eng.running == 1)

        def die():
            raise Die()
        eng.batch.step = die
        s.gate.open.set()
        r = fut.result()
    assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"]
    h = get(s.url + "/health")
    assert h.status_code == 503 and h.json()["engine_alive"] is False
    r = post(s.url + "/v1/completions", json={"prompt": "b", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503


def test_non_streaming_client_that_hangs_up_cancels_its_generation(serve):
    s = serve(gate="closed")  # the engine holds at its first forward: the request cannot finish by itself
    eng = s.srv.engine
    with pytest.raises(httpx.ReadTimeout):
        post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 500, "ignore_eos": True},
                   timeout=httpx.Timeout(60, read=1.0))
    s.until("the job cancelled", lambda: eng.stats.cancelled == 1 or (eng.active and eng.active[0].cancelled))
    s.gate.open.set()
    s.until("the slot freed", lambda: eng.running == 0 and eng.stats.cancelled == 1)
    assert eng.stats.cancelled_tokens <= 1
    assert "exactspec_cancelled_tokens" in get(s.url + "/metrics").text


def test_metrics_are_labelled_by_route_template_only(serve):
    s = serve()
    for i in range(5):
        get(s.url + f"/v1/no-such-thing-{i}")
    post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
    text = get(s.url + "/metrics").text
    assert "no-such-thing" not in text
    assert 'endpoint="/v1/completions",status="200"' in text and 'endpoint="(unmatched)",status="404"' in text


def test_slow_clients_are_cut_off_but_slow_generations_are_not(serve):
    s = serve(ServeOptions(read_timeout=1.0), gate="closed")
    with socket.create_connection(("127.0.0.1", s.port)) as sock:  # slowloris: headers that never end
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(10)
        t = time.perf_counter()
        assert sock.recv(100) == b""  # closed by the server
        assert 0.5 < time.perf_counter() - t < 8
    with cf.ThreadPoolExecutor(1) as ex:  # a request whose generation outlasts the read timeout
        fut = ex.submit(httpx.post, s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=120)
        time.sleep(2.0)
        s.gate.open.set()
        assert fut.result().status_code == 200


def test_host_header_check(serve):
    s = serve(ServeOptions(allowed_hosts=("good.example", "127.0.0.1")))
    assert get(s.url + "/v1/models", headers={"Host": "evil.example"}).status_code == 400
    assert get(s.url + "/v1/models").status_code == 200


@pytest.mark.parametrize("args,needle", [
    (["--max-batch", "2000", "--max-context", "100000"], "KV cache for 2000 sequences x 100000 positions"),
    (["--max-context", "1000000000"], "RoPE tables for max_context=1000000000 needs"),
    (["--max-body-bytes", "0"], "--max-body-bytes 0: must be > 0"),
    (["--read-timeout", "-1"], "--read-timeout -1.0: must be > 0"),
])
def test_startup_arguments_are_checked_before_allocating(folder, capsys, args, needle):
    from exactspec.cli import main
    assert main(["serve", "--model", str(folder), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


HOSTILE = [  # (path, raw JSON body, status, needle in the message, param) -- issue 27's table
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "lone surrogate", "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}', 400,
     "lone surrogate", "messages.0.content"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\udfff"], "max_tokens": 2}', 400, "lone surrogate", "stop"),
    ("/v1/completions", b'{"prompt": [true, 5], "max_tokens": 2}', 400, "valid integer", "prompt.0"),
    ("/v1/completions", b'{"prompt": [["5"]], "max_tokens": 2}', 400, "valid integer", "prompt.0.0"),  # ["5"]: one text
    ("/v1/chat/completions", b'{"messages": [{"role": "foo", "content": "hi"}], "max_tokens": 2}', 400,
     "'system', 'developer', 'user', 'assistant' or 'tool'", "messages.0.role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
     b'{"url": "http://x/y.png"}}]}], "max_tokens": 2}', 400, "'image_url' are not supported", "messages.0.content.0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "function_call": "auto"}', 400,
     "function_call", "function_call"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "yes"}',
     400, "valid boolean", "parallel_tool_calls"),
    # issue 40: lone surrogates anywhere (the 404 for an unknown model could not render its name: a 500)
    ("/v1/completions", b'{"prompt": "a", "model": "x\\ud800"}', 400, "lone surrogate", "model"),
    ("/v1/completions", b'{"prompt": "a", "user": "\\ud800"}', 400, "lone surrogate", "user"),
    ("/v1/completions", b'{"prompt": "a", "metadata": {"k": "\\udc00"}}', 400, "lone surrogate", "metadata.k"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "safety_identifier": "\\ud800"}',
     400, "lone surrogate", "safety_identifier"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": ["\\ud800"]}',
     400, "lone surrogate", "prompt_cache_key.0"),
    # strict types, as OpenAI's API: nothing coerced but an integer for a number
    ("/v1/completions", b'{"prompt": "a", "max_tokens": "5"}', 400, "valid integer", "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": true}', 400, "valid integer", "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 5.0}', 400, "valid integer", "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "temperature": "1"}', 400, "valid number", "temperature"),
    ("/v1/completions", b'{"prompt": "a", "temperature": 3}', 400, "less than or equal to 2", "temperature"),
    ("/v1/completions", b'{"prompt": "a", "n": "2"}', 400, "valid integer", "n"),
    ("/v1/completions", b'{"prompt": "a", "seed": "7"}', 400, "valid integer", "seed"),
    ("/v1/completions", b'{"prompt": "a", "logprobs": "1"}', 400, "valid integer", "logprobs"),
    ("/v1/completions", b'{"prompt": "a", "echo": 1}', 400, "valid boolean", "echo"),
    ("/v1/completions", b'{"prompt": "a", "stream": "yes"}', 400, "valid boolean", "stream"),
    ("/v1/completions", b'{"prompt": "a", "model": null}', 400, "not null", "model"),
    ("/v1/completions", b'{"prompt": "a", "best_of": 0}', 400, "best_of=0", "best_of"),
    ("/v1/completions", b'{"prompt": "a", "stop": ""}', 400, "empty stop string", "stop"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["x", ""]}', 400, "empty stop string", "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "needs 'content'", "messages.0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}', 400, "needs 'content'",
     "messages.0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}', 400,
     "valid boolean", "logprobs"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}', 400,
     "less than or equal to 2", "temperature"),
]


@pytest.mark.parametrize("path,body,status,needle,param", HOSTILE)
def test_hostile_request_fields_are_refused_by_name(serve, path, body, status, needle, param):
    s = serve()
    r = post(s.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param, err
    assert post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_max_completion_tokens_0_and_a_subnormal_temperature(serve, model):
    """max_completion_tokens 0 means 0 (it was read as unset); a temperature below 1e-5 is greedy
    (1e-45 used to overflow the logits into empty special tokens)."""
    s = serve()
    c = client(s)
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=0)
    assert r.usage.completion_tokens == 0 and r.choices[0].message.content == ""
    greedy = c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0)
    for t in (1e-45, 1e-320, 5e-6):
        tiny = c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=t, seed=3)
        assert tiny.choices[0].text == greedy.choices[0].text, t
    assert model.generate("def add(a, b):", 12, temperature=1e-45, seed=3).token_ids == \
        model.generate("def add(a, b):", 12).token_ids


def test_shutdown_admits_nothing_new_and_ends_every_request_cleanly(serve):
    """SIGTERM/SIGINT (uvicorn's handle_exit): new requests get a JSON 503, /health says so; the
    requests in flight get `shutdown_grace` seconds, then each stream ends with an error event and
    [DONE], and a waiting non-streaming request gets a JSON 503 (they were cut mid-stream, or got
    a plain-text 500). Then uvicorn exits."""
    s = serve(ServeOptions(shutdown_grace=1.0), gate="closed")

    def stream():
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"prompt": "def f(x):", "max_tokens": 500, "stream": True, "temperature": 0,
                                "ignore_eos": True}) as r:
            return r.status_code, [line for line in r.iter_lines() if line]
    with cf.ThreadPoolExecutor(4) as ex:
        streams = [ex.submit(stream) for _ in range(2)]
        whole = ex.submit(post, s.url + "/v1/completions", json={"prompt": "x = 1", "max_tokens": 500})
        s.until("all three submitted", lambda: s.srv.engine.running + s.srv.engine.queued == 3)
        for _ in range(8):  # steps, one at a time, until all three are in the batch with tokens out
            s.gate.step()
            s.until("the step used", lambda: s.gate.idle)
        s.uv.handle_exit(signal.SIGTERM, None)
        assert s.srv.draining_since is not None
        r = whole.result(timeout=30)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        for f in streams:
            status, lines = f.result(timeout=30)
            assert status == 200 and lines[-1] == "data: [DONE]"
            last = json.loads(lines[-2][6:])
            assert "shutting down" in last["error"]["message"]
            assert any(json.loads(x[6:]).get("choices") for x in lines[:-2])  # tokens came first
    s.thread.join(15)
    assert not s.thread.is_alive()  # uvicorn exited on its own
    s.gate.open.set()  # the engine, held at the gate, sees the cancels at its next step
    s.until("the ended requests leave the batch", lambda: s.srv.engine.running == 0)


def test_while_draining_new_requests_get_503(serve):
    s = serve(ServeOptions(shutdown_grace=30.0))
    s.srv.drain()  # as the signal does, without stopping uvicorn
    r = post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    h = get(s.url + "/health")
    assert h.status_code == 503 and h.json()["status"] == "shutting down"


def test_headers_over_16_kb_get_431(serve):
    """uvicorn's h11 limit bit only on headers split across reads: 17, 64, 100 KB in one write got 200."""
    s = serve()
    for kb in (17, 64, 100):
        r = post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"x-pad": "p" * (kb << 10)})
        assert r.status_code == 431 and "16384 bytes" in r.json()["error"]["message"], kb
    r = post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"x-pad": "p" * 15000})
    assert r.status_code == 200


@pytest.mark.parametrize("head,status", [("x-pad: " + "p" * (17 << 10), 431), ("Authorization: Bearer wrong", 401)])
def test_a_refusal_decided_on_the_headers_reads_the_body_first(serve, head, status):
    """A refusal decided on the headers (431, 401) answered and closed with the body unread. A socket closed
    with unread data sends RST, which can cut the answer off at the client: CI saw ECONNRESET reading a
    431's body (test_headers_over_16_kb_get_431, loaded machine). Now the body is read and dropped first
    (as BodyLimit's 413 does): no answer before the body has arrived, then the answer."""
    s = serve(ServeOptions(api_key="sekreT"))
    body = b'{"prompt": "a", "max_tokens": 1}'
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:
        c.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode())
        c.settimeout(0.5)
        with pytest.raises(TimeoutError):  # the server waits for the body: nothing to read yet
            c.recv(65536)
        c.settimeout(30)
        c.sendall(body)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = c.recv(65536)
            if not chunk:
                break
            got += chunk
    assert got.startswith(f"HTTP/1.1 {status} ".encode()), got[:80]


def test_a_20_mb_body_from_urllib_gets_its_413(serve):
    """urllib writes the whole body before it reads: the server must read (and drop) what it refused,
    or its close resets the connection under the client's writes."""
    import urllib.error
    import urllib.request
    s = serve()
    body = b'{"prompt": "' + b"x" * (20 << 20) + b'", "max_tokens": 2}'
    req = urllib.request.Request(s.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 413 and b"exceeds 1048576 bytes" in e.value.read()


def test_after_sigterm_an_idle_keep_alive_connection_gets_the_json_503(serve):
    """uvicorn closes idle keep-alive connections at once on a shutdown signal, so a request already
    on its way found the socket closed; they now linger 2 s, and such a request gets the 503."""
    s = serve(ServeOptions(shutdown_grace=1.0))
    with httpx.Client(timeout=30) as c:  # one connection, kept alive
        assert c.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
        s.uv.handle_exit(signal.SIGTERM, None)
        time.sleep(0.3)  # uvicorn's shutdown has run over the connections
        r = c.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert r.headers["connection"] == "close"
    s.thread.join(15)
    assert not s.thread.is_alive()


def test_a_template_rendering_stops_when_its_client_leaves(serve, folder, tmp_path):
    """The rendering runs in a worker thread; a client that hangs up stops it at its next 4096 steps,
    so it does not pin a core (or delay shutdown) for the rest of its budget."""
    from exactspec.text import chat
    d = tmp_path / "m"
    shutil.copytree(folder, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    loops = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": loops}))
    s = serve(model=exactspec.load(d))
    seen, real = [], chat.render

    def spy(*a, **kw):
        try:
            return real(*a, **{**kw, "max_steps": 10 ** 12})  # no budget: only the hang-up can stop it
        except chat.TemplateError as e:
            seen.append(str(e))
            raise
    chat.render = spy
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, timeout=1.0)
        s.until("the rendering stopped", lambda: seen)
    finally:
        chat.render = real
    assert seen == ["messages: the client left while the chat template rendered"]
