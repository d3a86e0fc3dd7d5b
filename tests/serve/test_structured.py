"""Structured output and tool calls over the wire, with the official `openai` client: response_format
(json_object, json_schema, and the client's `parse` with a pydantic model), llama.cpp's `grammar`,
tools with each tool_choice, streamed and not, a whole tool round trip; the answers of a server that
drafts (forced text, lookups) equal a plain one's field for field; bad schemas and tool histories are
400s naming the field."""
import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from exactspec.decode.drafters import LookupDrafter
from exactspec.serve.options import ServeOptions
from tests.serve.serving import InProcess, openai_client

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(BaseModel):
    kind: Literal["fox", "dog"]
    legs: int = Field(ge=0, le=8)
    ok: bool


@pytest.fixture(scope="module")
def servers(folder):
    """A plain server (no drafts at all: k = 0) and one that drafts (forced text + lookups, auto k)."""
    opts = ServeOptions(max_batch=4)
    plain = InProcess(folder, opts, num_draft_tokens=0)
    fast = InProcess(folder, opts, drafter=LookupDrafter(), num_draft_tokens="auto")
    for s in (plain, fast):
        s.gate.open.set()
    yield plain, fast
    for s in (plain, fast):
        s.stop()


def _post(s, path: str, body: dict) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=120)


def _same(a: dict, b: dict) -> None:
    """Two answers equal field for field but for the ids (the response's and the tool calls')."""
    for x in (a, b):
        x.pop("id"), x.pop("created")
        for c in x["choices"]:
            for t in (c.get("message") or {}).get("tool_calls") or []:
                t.pop("id")
    assert a == b


def test_parse_with_a_pydantic_model(servers):
    for s in servers:
        done = openai_client(s).chat.completions.parse(model="tiny", messages=ASK, response_format=Pet,
                                                       max_tokens=60, temperature=0)
        msg = done.choices[0].message
        assert isinstance(msg.parsed, Pet) and done.choices[0].finish_reason == "stop", msg


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_object"}, "max_tokens": 40},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}},
     "max_tokens": 60, "logprobs": True, "top_logprobs": 2},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}},
     "max_tokens": 60, "temperature": 1.2, "seed": 7, "n": 2},
    {"grammar": 'root ::= "yes" | "no" | "maybe so"', "max_tokens": 10},
    {"tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 300, "parallel_tool_calls": False},
    {"tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 340, "temperature": 1.0, "seed": 3},
    {"tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
     "max_tokens": 300, "parallel_tool_calls": False},
    {"tools": [WEATHER], "tool_choice": "auto", "max_tokens": 30},
])
def test_a_drafting_server_answers_as_a_plain_one(servers, body):
    plain, fast = (_post(s, "/v1/chat/completions", {"messages": ASK, "temperature": 0, **body}) for s in servers)
    assert plain.status_code == fast.status_code == 200, (plain.text, fast.text)
    a, b = plain.json(), fast.json()
    for c in a["choices"]:
        msg = c["message"]
        if body.get("tool_choice") not in (None, "auto"):
            # several calls may run out of tokens: "length", with the whole calls before the cut
            assert c["finish_reason"] == "tool_calls" or body.get("parallel_tool_calls") is None, c
            assert msg["content"] is None and msg["tool_calls"], c
            assert len(msg["tool_calls"]) == 1 or body.get("parallel_tool_calls") is not False
            for call in msg["tool_calls"]:
                assert call["type"] == "function" and call["id"].startswith("call_")
                args = json.loads(call["function"]["arguments"])
                name = call["function"]["name"]
                assert name == body["tool_choice"]["function"]["name"] if isinstance(body["tool_choice"], dict) \
                    else name in ("get_weather", "get_time")
                assert set(args) == ({"city", "days"} if name == "get_weather" else {"tz"})
        elif "response_format" in body and c["finish_reason"] == "stop":
            obj = json.loads(msg["content"])
            if body["response_format"]["type"] == "json_schema":
                Pet.model_validate(obj)
        elif "grammar" in body:
            assert msg["content"] in ("yes", "no", "maybe so")
    _same(a, b)


def test_tool_calls_stream_as_deltas(servers):
    plain, fast = servers
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=300,
              temperature=0, parallel_tool_calls=False)
    whole = openai_client(plain).chat.completions.create(**kw).choices[0].message.tool_calls
    for s in servers:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in openai_client(s).chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for d in ch.delta.tool_calls or []:
                    c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls"
        assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                      for c in whole]


def test_a_tool_round_trip(servers):
    plain, _ = servers
    client = openai_client(plain)
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=300, temperature=0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sun", "c": 21})}]
    answers = [openai_client(s).chat.completions.create(model="tiny", messages=history, tools=[WEATHER],
                                                         max_tokens=12, temperature=0) for s in servers]
    assert answers[0].choices[0].message == answers[1].choices[0].message
    assert answers[0].choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the tool's answer reached the prompt (the template has no tools: the fallback renders it as text)
    seen = []
    real = plain.srv._chat_prompt
    plain.srv._chat_prompt = lambda r, tp, cancelled=None: seen.append(r) or real(r, tp, cancelled)
    try:
        client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=1)
    finally:
        plain.srv._chat_prompt = real
    text = plain.model.decode(real(seen[0], None))
    assert "<tool_response>" in text and '"forecast": "sun"' in text and "get_weather" in text


class Where(BaseModel):
    city: Literal["Paris", "Oslo"]


class Trip(BaseModel):  # nested: pydantic_function_tool writes `$defs` and a root-relative `$ref`
    where: Where
    back: Where | None = None
    days: int = Field(ge=1, le=9)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Trip"}}, "auto+format"])
def test_forced_calls_take_pydantic_function_tools_with_refs(servers, choice):
    """`$ref: "#/$defs/..."` in a tool's parameters points into that tool's schema, wherever the
    grammar of calls puts it (it was refused: the refs broke once nested under the call schema)."""
    tool = openai.pydantic_function_tool(Trip)
    kw = {"tool_choice": choice} if choice != "auto+format" else {
        "tool_choice": "auto", "response_format": {"type": "json_schema", "json_schema": {"name": "pet",
                                                                                        "schema": Pet.model_json_schema()}}}
    for s in servers:
        r = _post(s, "/v1/chat/completions", {"messages": ASK, "tools": [tool], "max_tokens": 120,
                                              "temperature": 0, "parallel_tool_calls": False, **kw})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        for c in msg.get("tool_calls") or []:
            if c["function"]["name"] == "Trip":
                Trip.model_validate_json(c["function"]["arguments"])
        if choice != "auto+format":
            assert msg["tool_calls"], msg


def test_completions_take_response_format_and_grammar(servers):
    for body in ({"response_format": {"type": "json_object"}, "max_tokens": 40},
                 {"grammar": "start: /[0-9]{3}/", "max_tokens": 8}):
        plain, fast = (_post(s, "/v1/completions", {"prompt": "numbers:", "temperature": 0, **body}) for s in servers)
        assert plain.status_code == 200, plain.text
        _same(plain.json(), fast.json())
        text = plain.json()["choices"][0]["text"]
        if "grammar" in body:
            assert len(text) == 3 and text.isdigit()


@pytest.mark.parametrize("path,extra,param,needle", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "strin"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format"}}}}, "response_format.json_schema.schema", "format"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' is given"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ("chat", {"grammar": "root ::= undefined_rule"}, "grammar", "undefined_rule"),
    ("chat", {"grammar": "root ::= root"}, "grammar", "allows no text"),
    ("chat", {"grammar": 'root ::= "a"{1000000}'}, "grammar", "Too many items"),
    ("chat", {"grammar": 'root ::= "0" | [a-z] "b"{1000000}'}, "grammar", "Too many items"),  # met after 1 token
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}}}},
     "response_format.json_schema.schema", "allows no text"),
    ("chat", {"grammar": "x", "response_format": {"type": "json_object"}}, "grammar", "not both"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "no tool named 'nope'"),
    ("chat", {"tools": [WEATHER, WEATHER]}, "tools", "share a name"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
              "tool_choice": "required"}, "tools.0.function.parameters", "parameters"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}], "tool_choice": "required"}, "tools", "strin"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", ""),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
              "tool_choice": "required"}, "tools.0.function.parameters", "must be a JSON schema of an object"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "tool_call_id"),
    ("chat", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c1"}]}, "messages.0.tool_call_id",
     "answers no earlier tool call"),
    ("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0", "only an assistant"),
    ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages.0.tool_calls.0.type", "Field required"),
    ("text", {"tools": [WEATHER]}, "tools", "not supported"),
])
def test_bad_structures_are_named_400s(servers, path, extra, param, needle):
    body = {"messages": ASK, "max_tokens": 3, **extra} if path == "chat" else {"prompt": "a", "max_tokens": 2, **extra}
    r = _post(servers[0], "/v1/chat/completions" if path == "chat" else "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param, err
