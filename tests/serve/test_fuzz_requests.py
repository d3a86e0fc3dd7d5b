"""Fuzzing the request schema against the real server (bounded: a few hundred bodies): OpenAI's
fields with values of every JSON type, nested junk, lone surrogates. Every body gets a 200 or a
4xx with an OpenAI error body naming a param or a message, never a 500, and the server keeps serving."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from exactspec.serve.options import ServeOptions
from tests.serve.serving import InProcess

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def srv(folder):
    s = InProcess(folder, ServeOptions(max_batch=4, max_n=3))
    s.gate.open.set()
    yield s
    s.stop()


text = st.one_of(st.text(max_size=12), st.sampled_from(["\ud800", "a\udfffb", "", " ", "tiny", "x" * 300]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.integers(-2 ** 70, 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), text)
junk = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(text, c, max_size=3)),
                    max_leaves=6)
ids = st.lists(st.one_of(st.integers(-2, 400), scalars), max_size=6)
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "x"]),
                                                  junk)},
                                optional={"content": st.one_of(text, junk, st.lists(st.fixed_dictionaries(
                                    {"type": st.sampled_from(["text", "image_url"]), "text": junk}), max_size=2)),
                                          "name": junk, "tool_calls": junk, "tool_call_id": junk})
# structured output and tools: real shapes with junk inside (schemas, names, choices), and junk itself
schema = st.one_of(junk, st.just({"type": "object"}), st.fixed_dictionaries(
    {"type": st.sampled_from(["object", "string", "integer", "array", "strin"])},
    optional={"properties": st.dictionaries(text, st.one_of(junk, st.just({"type": "integer"})), max_size=2),
              "required": st.lists(text, max_size=2), "enum": st.lists(scalars, max_size=3), "pattern": text,
              "minimum": scalars, "items": junk, "format": text}))
response_format = st.one_of(junk, st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object",
                                                                                  "json_schema", "x"])},
                                                        optional={"json_schema": st.fixed_dictionaries(
                                                            {"name": text}, optional={"schema": schema,
                                                                                      "strict": junk})}))
tool = st.one_of(junk, st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["f", "get_x"]), text)},
    optional={"parameters": schema, "description": text})}))
tool_choice = st.one_of(junk, st.sampled_from(["none", "auto", "required"]),
                        st.fixed_dictionaries({"type": st.just("function"),
                                               "function": st.fixed_dictionaries({"name": text})}))
COMMON = {"model": st.one_of(st.just("tiny"), junk), "max_tokens": st.one_of(st.integers(0, 3), junk),
          "temperature": st.one_of(st.floats(0, 2.5), junk), "top_p": st.one_of(st.floats(0, 1.5), junk),
          "top_k": junk, "min_p": junk, "seed": st.one_of(st.integers(-1, 2 ** 64), junk),
          "stop": st.one_of(text, st.lists(text, max_size=3), junk), "stream": st.one_of(st.booleans(), junk),
          "n": st.one_of(st.integers(0, 4), junk), "stream_options": junk, "user": junk, "metadata": junk,
          "ignore_eos": junk, "receipt": junk, "cache_salt": junk, "logit_bias": junk,
          "tools": st.one_of(junk, st.lists(tool, max_size=2)), "tool_choice": tool_choice,
          "parallel_tool_calls": junk, "response_format": response_format,
          "grammar": st.one_of(junk, text, st.sampled_from(['root ::= "a"', "start: /[0-9]+/", "root ::="])),
          "unknown_field": junk}
completions = st.fixed_dictionaries({"prompt": st.one_of(text, ids, st.lists(ids, max_size=2),
                                                         st.lists(text, max_size=2), junk)},
                                    optional={**COMMON, "logprobs": st.one_of(st.integers(-1, 21), junk),
                                              "echo": junk, "best_of": st.one_of(st.integers(0, 4), junk),
                                              "suffix": junk})
chats = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, min_size=0, max_size=3), junk)},
                              optional={**COMMON, "logprobs": junk, "top_logprobs": st.one_of(st.integers(-1, 21), junk),
                                        "max_completion_tokens": st.one_of(st.integers(0, 3), junk),
                                        "prediction": junk})


def _encode(body) -> bytes:
    """JSON as a client may send it: lone surrogates escaped (\\ud800), NaN and Infinity as Python writes them."""
    return json.dumps(body, ensure_ascii=True).encode()


def _check(s, path: str, body) -> None:
    r = httpx.post(s.url + path, content=_encode(body), headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], (r.text, body)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"server_error"' not in r.text, (r.text, body)


@pytest.mark.slow
@SETTINGS
@given(body=completions)
def test_any_completions_body_gets_200_or_a_named_4xx(srv, body):
    _check(srv, "/v1/completions", body)


@pytest.mark.slow
@SETTINGS
@given(body=chats)
def test_any_chat_body_gets_200_or_a_named_4xx(srv, body):
    _check(srv, "/v1/chat/completions", body)
