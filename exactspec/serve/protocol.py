"""The OpenAI wire format: request bodies (pydantic), error bodies, response and SSE chunk shapes.

Knows JSON shapes only: no model, no engine. The bodies check JSON types; value ranges (a
temperature below 0, a prompt longer than the context) are checked once, by
request.make_request, and come back here as InvalidRequest to be shaped into a 400.
"""
from __future__ import annotations

import json
import secrets

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from ..decode.sampling import SamplingParams
from ..errors import ContextLengthError, InvalidRequest

# our field names (request.make_request) -> OpenAI's
WIRE_NAMES = {"max_new_tokens": "max_tokens", "token_ids": "prompt"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @classmethod
    def invalid(cls, e: InvalidRequest) -> "APIError":
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        param = WIRE_NAMES.get(e.field, e.field) if e.field else None
        return cls(400, str(e), param=param, code=code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body. A message or param that echoes a client's lone surrogate shows it escaped
    (\\ud800): the body must encode as UTF-8."""
    def safe(s: str | None) -> str | None:
        return s.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(s, str) else s
    return {"error": {"message": safe(message), "type": type_, "param": safe(param), "code": code}}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's deepest error (for a union, the branch that got furthest) as (message, field path)."""
    e = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    union_tags = {"body", "str", "int", "float", "bool", "dict", "list"}  # pydantic names union branches in loc
    where = ".".join(str(x) for x in e.get("loc", ()) if isinstance(x, int) or
                     (x not in union_tags and x.isidentifier() and not x[:1].isupper()))
    msg = e.get("msg", "invalid request")
    if e.get("type") == "json_invalid":
        msg = f"request body is not valid JSON ({e.get('ctx', {}).get('error', msg)})"
    return (f"{where}: {msg}" if where else msg), where or None


def _surrogate_at(s: str) -> int | None:
    """Where a lone surrogate sits in `s` (JSON allows \\ud800, UTF-8 text does not), or None."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _utf8(v):
    """Strings (in lists too) must be encodable as UTF-8: JSON allows a lone surrogate (\\ud800), text
    does not (the tokenizer would fail deep inside: a 500)."""
    for x in ([v] if isinstance(v, str) else v if isinstance(v, list) else []):
        if isinstance(x, str) and (at := _surrogate_at(x)) is not None:
            raise ValueError(f"not valid Unicode text (a lone surrogate at character {at})")
    return v


def _utf8_deep(v):
    """_utf8 for any JSON value (a schema, a tool's parameters): a ValueError naming where a lone surrogate sits."""
    try:
        _no_surrogates(v, "")
    except APIError as e:
        raise ValueError(e.message.lstrip(".: ")) from None
    return v


def _no_surrogates(v, where: str) -> None:
    """400 for a lone surrogate anywhere in a JSON value (strings, list items, object keys and values)."""
    stack = [(v, where)]
    while stack:
        x, path = stack.pop()
        if isinstance(x, str) and (at := _surrogate_at(x)) is not None:
            raise APIError(400, f"{path}: not valid Unicode text (a lone surrogate at character {at})", param=path)
        if isinstance(x, list):
            stack += [(y, f"{path}.{i}") for i, y in enumerate(x)]
        elif isinstance(x, dict):
            stack += [(k, path) for k in x] + [(y, f"{path}.{k}") for k, y in x.items()]


# Every body model is strict, as OpenAI's API is: an integer is a number too, nothing else is coerced
# ("5" is not 5, true is not 1, 1 is not true).
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None  # a last chunk with the usage
    include_obfuscation: bool | None = None  # random padding in each chunk (OpenAI's default; ours: off)


class _Sampling(BaseModel):
    # extra fields kept to be named: refuse_unsupported refuses what it does not know
    model_config = ConfigDict(extra="allow", strict=True)

    _check_stop = field_validator("stop", "model")(_utf8)
    model: str | None = None  # absent: the served model; null is refused (as OpenAI does)
    max_tokens: int | None = None
    temperature: float = Field(1.0, le=2.0)  # OpenAI's range: 0..2
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's extension: keep going past EOS until max_tokens
    receipt: bool = False  # ours: the answer carries a top-level `receipt` (exactspec/receipt.py)
    response_format: "ResponseFormat | None" = None  # OpenAI's: JSON (any object, or a schema's)
    grammar: str | None = None  # llama.cpp's extension: a GBNF grammar (or Lark) the answer follows
    _check_grammar = field_validator("grammar")(_utf8)
    cache_salt: str | None = Field(None, max_length=256)  # vLLM's: the prefix cache shares only within one salt
    _check_salt = field_validator("cache_salt")(_utf8)

    @field_validator("model", mode="before")
    @classmethod
    def _model_not_null(cls, v):
        if v is None:  # absent is fine (the served model); an explicit null is refused, as OpenAI does
            raise ValueError("must be a string (the served model's name), not null")
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v):
        if v == "" or isinstance(v, list) and "" in v:
            raise ValueError("an empty stop string would match before any text")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def obfuscate(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_obfuscation)

    def params(self) -> SamplingParams:
        """The body's sampling parameters (checked: InvalidRequest naming the field); seed as sent."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty, self.seed)


class CompletionRequest(_Sampling):
    # one prompt (text or token ids; strict: `true` or "5" is not a token id) or several (a list of
    # texts or of token-id lists: n choices each, numbered on across prompts, as OpenAI's API)
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    _check_prompt = field_validator("prompt")(_utf8)
    logprobs: int | None = None  # per token: its logprob and this many alternatives (<= 20)
    echo: bool = False  # the prompt (its tokens' logprobs too) before the completion; max_tokens 0: scoring
    best_of: int | None = None  # candidates generated; the n with the highest mean logprob are returned

    def prompts(self) -> list:
        """The prompts of the body: each a text or a list of token ids."""
        p = self.prompt
        return list(p) if isinstance(p, list) and p and not isinstance(p[0], int) else [p]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # an image part's fields: named in the refusal below
    type: str
    text: str | None = None
    _check_text = field_validator("text")(_utf8)

    @model_validator(mode="after")
    def _text_part_has_text(self) -> "ContentPart":
        if self.type != "text":  # images, audio, files: refused, never dropped
            raise ValueError(f"content parts of type {self.type!r} are not supported (text only)")
        if self.text is None:
            raise ValueError("a content part of type 'text' needs a string 'text'")
        if self.model_extra:
            raise ValueError(f"a text part has 'type' and 'text' only, not {', '.join(map(repr, self.model_extra))}")
        return self


def _text(content: str | list[ContentPart] | None) -> str:
    """A content as text: a string, or the text parts of [{"type": "text", "text": ...}, ...]."""
    return "".join(p.text or "" for p in content) if isinstance(content, list) else content or ""


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI's API sends it
    _check = field_validator("name", "arguments")(_utf8)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: FunctionCall
    _check = field_validator("id")(_utf8)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)  # given to the chat template, as transformers does
    _check_content = field_validator("content", "name")(_utf8)
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (its content may then be null)
    tool_call_id: str | None = None  # a tool message answers this call
    _check_id = field_validator("tool_call_id")(_utf8)
    # an assistant turn's audio and refusal, the old function_call: refused when set
    function_call: dict | None = None
    audio: dict | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _check_turn(self) -> "ChatMessage":
        for f in ("function_call", "audio", "refusal"):
            if getattr(self, f) is not None:
                raise ValueError(f"'{f}' in a message is not supported by this server")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has 'tool_calls'")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("a tool message needs 'tool_call_id' (and only a tool message has one)")
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs 'content' (a string or a list of text parts)")
        return self

    def text(self) -> str:
        return _text(self.content)


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # absent: any JSON object
    strict: bool | None = None
    _check = field_validator("name", "description", "schema_")(_utf8_deep)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is given with type 'json_schema', and only then")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (absent: no arguments)
    strict: bool | None = None
    _check = field_validator("description", "parameters")(_utf8_deep)

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v):
        """A call's arguments are a JSON object (OpenAI's rule): a schema of another type is refused."""
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f"a tool's parameters must be a JSON schema of an object (\"type\": \"object\"), "
                             f"not of type {v.get('type')!r}")
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    _check = field_validator("name")(_utf8)


class NamedTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a file it edits). Drafts."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["content"]
    content: str | list[ContentPart]
    _check_content = field_validator("content")(_utf8)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token (<= 20), with logprobs=true
    prediction: Prediction | None = None  # honoured: its tokens are drafts (usage counts them)
    tools: list[Tool] | None = None  # functions the model may call (rendered by the chat template)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None  # default: auto with tools
    parallel_tool_calls: bool | None = None  # default true: several calls in one answer

    def predicted(self) -> str:
        return _text(self.prediction.content) if self.prediction is not None else ""


# OpenAI fields that say who asks or steer OpenAI's own storage and caching: they change no output,
# so they are accepted and not used (the prefix cache here is keyed by the exact tokens).
INFORMATIONAL = {"user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"}
# OpenAI fields we cannot honour: accepted at their defaults, refused when set (never silently ignored).
UNSUPPORTED = {"suffix": (None, ""), "logit_bias": (None, {}), "functions": (None, []),
               "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),  # completions
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "function_call": (None, "none"), "store": (None, False),
               "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]), "audio": (None,),
               "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,)}


def refuse_unsupported(r: BaseModel) -> None:
    """400 for a field set to what we cannot honour, and for a field OpenAI's API does not define
    (as OpenAI answers: a misspelt `temprature` must not pass as the default)."""
    for name, v in (r.model_extra or {}).items():
        _no_surrogates(name, "a request argument's name")
        _no_surrogates(v, name)
        if name in UNSUPPORTED and v not in UNSUPPORTED[name]:
            raise APIError(400, f"{name}={v!r} is not supported by this server", param=name)
        if name not in UNSUPPORTED and name not in INFORMATIONAL:
            raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name)


class Shapes:
    """Response bodies of one request: a whole completion, or its stream of chunks."""

    def __init__(self, kind: str, rid: str, created: int, model: str, obfuscate: bool = False):
        self.kind, self.rid, self.created, self.model, self.obfuscate = kind, rid, created, model, obfuscate

    def choice(self, text: str | None, finish: str | None, delta: bool, index: int = 0, logprobs: dict | None = None,
               tool_calls: list[dict] | None = None) -> dict:
        """A choice; with `tool_calls` (chat), its calls: whole, or as one delta each with its index."""
        if self.kind == "chat":
            msg: dict = {"role": "assistant", "content": text}
            if tool_calls:
                msg["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)] if delta else tool_calls
            body = {"delta" if delta else "message": msg}
        else:
            body = {"text": text}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish}

    def whole(self, choices: list[dict], usage: dict) -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def chunk(self, text: str | None = "", finish: str | None = None, usage: dict | None = None,
              logprobs: dict | None = None, index: int = 0, fields: dict | None = None,
              tool_calls: list[dict] | None = None) -> bytes:
        """A chunk of choice `index`; with `usage` (or other top-level `fields`, the receipt): a chunk
        with no choices carrying them."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        fields = {**(fields or {}), **({"usage": usage} if usage is not None else {})}
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [] if fields else [self.choice(text, finish, True, index, logprobs, tool_calls)], **fields}
        if self.obfuscate:  # OpenAI's stream_options.include_obfuscation: chunk sizes no longer tell the text's
            body["obfuscation"] = secrets.token_urlsafe(secrets.randbelow(12) + 1)
        return sse(body)



def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, predicted: tuple[int, int] = (0, 0)) \
        -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens whose keys came from the prefix cache;
    predicted: the prediction's draft tokens (accepted, rejected) by the target."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": predicted[0],
                                          "rejected_prediction_tokens": predicted[1]}}


def completion_logprobs(tokens: list[str], logprobs: list[float | None], tops: list[dict | None] | None,
                        offset: int = 0) -> dict:
    """OpenAI's legacy completions `logprobs` object; text_offset counts characters from `offset`."""
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]]) -> dict:
    """OpenAI's chat `logprobs` object: content[] with token, logprob, bytes, top_logprobs."""
    def entry(t: str, lp: float) -> dict:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                        for t, lp, top in zip(tokens, logprobs, tops)]}


for _m in (_Sampling, CompletionRequest, ChatRequest):  # response_format's class is defined after _Sampling
    _m.model_rebuild()
