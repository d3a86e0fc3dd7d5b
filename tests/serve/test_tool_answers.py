"""An answer's text read for tool calls, and the same answer whole and streamed: a client that joins the
stream's deltas (as the openai client does) gets the message and finish reason of the whole answer, for
every shape of answer (content and calls, several calls, calls cut by max_tokens, a call whose strings
hold markup, a block naming no offered tool, no text at all). No model: each answer's text is given."""
import asyncio
import json
import types

import pytest

from exactspec.serve import tools
from exactspec.serve.protocol import ChatRequest
from exactspec.serve.respond import Reply, _Chunks

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(city: str, name: str = "get_weather") -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"city": city}}) + "\n</tool_call>"


class Answer:
    """A Generation whose answer is given: one text piece, then its finish reason."""

    def __init__(self, text: str, finish: str):
        self.text, self.finish, self.finish_reason = text, finish, None
        self.lp, self.tokens, self.cached_tokens, self.predicted = [], [0] * len(text), 0, (0, 0)
        self.job = types.SimpleNamespace(req=types.SimpleNamespace(params=types.SimpleNamespace(seed=None)))

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    async def pieces(self):
        yield self.text
        self.finish_reason = self.finish


def reply(parallel: bool) -> Reply:
    r = ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], parallel_tool_calls=parallel)
    app = types.SimpleNamespace(name="tiny", model=None)
    req = types.SimpleNamespace(prompt=[1, 2], max_new_tokens=10)
    return Reply(app, "chat", r, [req], False, False, None, tools.plan(r))


def joined(stream: list[bytes]) -> tuple[dict, str | None]:
    """The message and finish reason a client assembles from a stream's chunks."""
    content, calls, finish = None, {}, None
    for line in b"".join(stream).decode().split("\n\n"):
        if not line.startswith("data: {"):
            continue
        for ch in json.loads(line[6:])["choices"]:
            d = ch["delta"]
            if d.get("content") is not None:
                content = (content or "") + d["content"]
            for t in d.get("tool_calls") or []:
                c = calls.setdefault(t["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                c["id"] += t.get("id") or ""
                c["function"]["name"] += t["function"].get("name") or ""
                c["function"]["arguments"] += t["function"].get("arguments") or ""
            finish = ch["finish_reason"] or finish
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish


async def both(text: str, finish: str, parallel: bool) -> tuple[tuple[dict, str], tuple[dict, str]]:
    rp = reply(parallel)
    whole = json.loads((await rp.whole([Answer(text, finish)], None)).body)["choices"][0]
    gens = [Answer(text, finish)]
    chunks = [c async for c in rp._whole_chunks(_Chunks(rp, gens), gens)]
    msg = dict(whole["message"])
    msg["content"] = msg["content"] or None
    return (msg, whole["finish_reason"]), joined(chunks)


SHAPES = [  # text, finish, parallel calls, expected (content, [cities], finish)
    ("Let me check.\n" + call("Oslo"), "stop", True, ("Let me check.", ["Oslo"], "tool_calls")),
    ("Two: " + call("Oslo") + "\n" + call("Paris"), "stop", True, ("Two:", ["Oslo", "Paris"], "tool_calls")),
    (call("Oslo") + "\n" + call("Paris"), "stop", False, (call("Paris"), ["Oslo"], "tool_calls")),
    (call("a</tool_call>b"), "stop", True, (None, ["a</tool_call>b"], "tool_calls")),
    (call("Oslo") + "\n" + call("Oslo") + "\n<tool", "length", True, (None, ["Oslo", "Oslo"], "length")),
    (call("Oslo") + '\n<tool_call>\n{"name": "get_wea', "length", True, (None, ["Oslo"], "length")),
    ('Sure.\n<tool_call>\n{"name": "get_weather", "argum', "length", True, ("Sure.\n", [], "length")),
    ("Sure, one moment <tool", "length", True, ("Sure, one moment ", [], "length")),
    ("a < b and c <", "stop", True, ("a < b and c <", [], "stop")),
    (call("Oslo", name="nope"), "stop", True, (call("Oslo", name="nope"), [], "stop")),
    ("just text", "stop", True, ("just text", [], "stop")),
    ("", "length", True, (None, [], "length")),
]


@pytest.mark.parametrize("text,finish,parallel,want", SHAPES)
def test_streamed_and_whole_answers_are_the_same_message(text, finish, parallel, want):
    (msg, fin), (smsg, sfin) = asyncio.run(both(text, finish, parallel))
    calls = msg.get("tool_calls") or []
    assert (msg["content"], [json.loads(c["function"]["arguments"])["city"] for c in calls], fin) == want
    assert all(c["function"]["name"] == "get_weather" and c["id"].startswith("call_") for c in calls)
    for c in [*calls, *(smsg.get("tool_calls") or [])]:
        c.pop("id")  # each answer draws its own call ids
    assert (smsg, sfin) == (msg, fin)
