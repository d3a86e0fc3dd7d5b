"""Structured output and tool calls on the wire: a body's `response_format`, `grammar`, `tools` and
`tool_choice` as one constraint (decode/constraint.py), the messages and tools as the chat template
takes them, and an answer's text as OpenAI's `tool_calls`.

The call format is the Hermes one most open chat templates use (Qwen2.5/3, SmolLM3, Hermes):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. A template that renders `tools` itself gets them (transformers' convention); one
that does not (SmolLM2's) gets them in a system message (FALLBACK) and the tool turns as text. With
tool_choice "required" or a named function the answer is grammar-constrained to such blocks, so it
always parses; with "auto" the model chooses, and blocks that parse become calls.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from ..api import Model
from ..decode.constraint import Grammar, lark_json
from ..errors import InvalidRequest
from .protocol import APIError, ChatMessage, ChatRequest, Tool, _Sampling

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
_OPEN_TAG, _CLOSE_TAG = OPEN.strip(), CLOSE.strip()
FALLBACK = ("You can call functions. To call one, answer with a block\n<tool_call>\n{\"name\": <the function's "
            "name>, \"arguments\": <its arguments as a JSON object>}\n</tool_call>\nfor each call, and nothing "
            "else. The functions:\n")


@dataclass
class ToolPlan:
    """How one chat body uses tools: those offered (after tool_choice), whether the answer is parsed
    for calls, and whether several calls may come back."""
    tools: list[Tool]
    parse: bool
    parallel: bool


def plan(r: ChatRequest) -> ToolPlan | None:
    if r.tool_choice is not None and not r.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if not r.tools:
        return None
    tools = r.tools
    if not isinstance(r.tool_choice, str) and r.tool_choice is not None:
        tools = [t for t in r.tools if t.function.name == r.tool_choice.function.name]
        if not tools:
            raise APIError(400, f"tool_choice: no tool named {r.tool_choice.function.name!r} in tools",
                           param="tool_choice")
    names = [t.function.name for t in r.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools share a name", param="tools")
    return ToolPlan(tools, r.tool_choice != "none", r.parallel_tool_calls is not False)


def _rebased(v, base: str):
    """A schema moved to the JSON pointer `base` of a larger one: its document-local `$ref`s ("#",
    "#/$defs/X", "#/properties/a") made to point where their targets now are."""
    if isinstance(v, dict):
        return {k: (base + x[1:] if k == "$ref" and isinstance(x, str) and x.startswith("#") else _rebased(x, base))
                for k, x in v.items()}
    if isinstance(v, list):
        return [_rebased(x, base) for x in v]
    return v


def _call_schema(tools: list[Tool]) -> dict:
    """One schema for a call of any of the tools: {"name": its name, "arguments": its parameters}, each
    tool's parameters rebased where they sit (pydantic's `$defs` refs keep working)."""
    def one(i: int, t: Tool) -> dict:
        args = t.function.parameters if t.function.parameters is not None else {"type": "object", "properties": {}}
        return {"type": "object", "properties": {"name": {"const": t.function.name},
                                                 "arguments": _rebased(args, f"#/anyOf/{i}/properties/arguments")},
                "required": ["name", "arguments"], "additionalProperties": False}
    return {"anyOf": [one(i, t) for i, t in enumerate(tools)]}


def _json_schema(r: _Sampling) -> dict | None:
    f = r.response_format
    if f is None or f.type == "text":
        return None
    if f.type == "json_object" or f.json_schema.schema_ is None:
        return {"type": "object"}
    return f.json_schema.schema_


def constraint(model: Model, r: _Sampling, tp: ToolPlan | None) -> Grammar | None:
    """The body's constraint: response_format, llama.cpp's `grammar`, forced tool calls (tool_choice
    "required" or named), or with "auto" and a response_format: a call or the formatted answer."""
    schema = _json_schema(r)
    if schema is not None and r.grammar is not None:
        raise APIError(400, "give response_format or grammar, not both", param="grammar")
    forced = tp is not None and tp.parse and (r.tool_choice == "required" or not isinstance(r.tool_choice, str)
                                              and r.tool_choice is not None)
    if r.grammar is not None and tp is not None and tp.parse:
        raise APIError(400, "grammar with tools: set tool_choice 'none', or leave the grammar out", param="grammar")
    try:
        if tp is not None and tp.parse and (forced or schema is not None):
            calls = 'calls: call ("\\n" call)*\n' if tp.parallel else "calls: call\n"
            lark = (f"start: calls{' | answer' if not forced else ''}\n" + calls +
                    f"call: {json.dumps(OPEN)} body {json.dumps(CLOSE)}\nbody: {lark_json(_call_schema(tp.tools))}\n")
            if not forced:
                lark += f"answer: {lark_json(schema)}\n"
            return model.constraint("grammar", lark, "tools")
        if schema is not None:
            name = "response_format.json_schema.schema" if r.response_format.type == "json_schema" else \
                "response_format"
            return model.constraint("json_schema", schema, name)
        if r.grammar is not None:
            return model.constraint("grammar", r.grammar)
    except InvalidRequest as e:
        if e.field == "tools":  # which part of the tools' grammar: a tool's parameters schema, or the schema
            e = InvalidRequest(f"tools: a tool's 'parameters' (or the response_format schema) is not a schema the "
                               f"grammar takes: {str(e).split(': ', 1)[-1]}", "tools")
        raise APIError.invalid(e) from None
    return None


def _arguments(call) -> dict | str:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def messages(r: ChatRequest, tp: ToolPlan | None, template: str) -> tuple[list[dict], list[dict] | None]:
    """The messages (and the tools) as the chat template takes them: transformers' form where the
    template renders tools itself, text (FALLBACK) where it does not."""
    native = "tools" in template or "tool_calls" in template
    out = []
    for m in r.messages:
        d: dict = {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        if m.tool_calls and native:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c)}}
                               for c in m.tool_calls]
        elif m.tool_calls:
            d["content"] = (d["content"] + "\n" if d["content"] else "") + "\n".join(
                OPEN + json.dumps({"name": c.function.name, "arguments": _arguments(c)}) + CLOSE for c in m.tool_calls)
        if m.role == "tool" and native:
            d["tool_call_id"] = m.tool_call_id
        elif m.role == "tool":
            d = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        out.append(d)
    tools = [t.model_dump(exclude_none=True) for t in tp.tools] if tp is not None else None
    if tools and not native:
        text = FALLBACK + "\n".join(json.dumps(t["function"]) for t in tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": text + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, tools if native else None


def _block(text: str, at: int) -> tuple[object, int] | None:
    """The JSON value of the call block opening at `at` and the index past its close, read as JSON (a
    string inside it may hold any text, "</tool_call>" too); None if it is not one whole block."""
    j = at + len(_OPEN_TAG)
    while j < len(text) and text[j].isspace():
        j += 1
    try:
        value, j = json.JSONDecoder().raw_decode(text, j)
    except ValueError:
        return None
    while j < len(text) and text[j].isspace():
        j += 1
    return (value, j + len(_CLOSE_TAG)) if text.startswith(_CLOSE_TAG, j) else None


def _cut_markup(text: str, cut: bool) -> str:
    """The text less a call block that never closed, and, in an answer cut by max_tokens (`cut`), less
    the start of an opening tag at its very end ("<tool"): markup is not content."""
    if (j := text.rfind(_OPEN_TAG)) >= 0 and _CLOSE_TAG not in text[j:]:
        return text[:j]
    if cut:
        for n in range(len(_OPEN_TAG) - 1, 0, -1):
            if text.endswith(_OPEN_TAG[:n]):
                return text[:-n]
    return text


def calls(text: str, tp: ToolPlan, cut: bool = False) -> tuple[str | None, list[dict]]:
    """An answer's text as (content, OpenAI tool_calls): every block naming an offered tool with an
    arguments object is a call (parsed as the JSON it is; one only unless tp.parallel); the text around
    them is the content (None when there is none, with calls). A block that never closed is dropped, and
    with `cut` (the answer ran out of tokens) a trailing "<tool": markup is never left in the content."""
    names = {t.function.name for t in tp.tools}
    found, kept, at = [], [], 0
    while (i := text.find(_OPEN_TAG, at)) >= 0 and (found == [] or tp.parallel):
        got = _block(text, i)
        if got is None:  # not a whole block: text up to the next opening
            kept.append(text[at:i + 1])
            at = i + 1
            continue
        c, end = got
        if isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments"), dict):
            found.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                          "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}})
            kept.append(text[at:i])
        else:
            kept.append(text[at:end])
        at = end
    kept.append(text[at:])
    if not found:
        return _cut_markup(text, cut), []
    return (_cut_markup("".join(kept), cut).strip() or None), found


def check_history(msgs: list[ChatMessage]) -> None:
    """Each tool message answers a call an assistant message made before it."""
    made = set()
    for i, m in enumerate(msgs):
        made |= {c.id for c in m.tool_calls or ()}
        if m.role == "tool" and m.tool_call_id not in made:
            raise APIError(400, f"messages.{i}.tool_call_id: {m.tool_call_id!r} answers no earlier tool call",
                           param=f"messages.{i}.tool_call_id")
