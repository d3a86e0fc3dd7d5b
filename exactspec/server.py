"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching engine.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming or not), /health,
/metrics (Prometheus). Errors are OpenAI-style JSON bodies with 4xx codes; the server keeps
serving. The `model` field is matched against the served name only: nothing a client sends is
ever opened as a file.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from . import chat
from .api import Model
from .drafters import Drafter
from .engine import Engine, QueueFull, Request
from .errors import ContextLengthError, ExactSpecError, InvalidArgumentError
from .sampling import SamplingParams
from .tokenizer import StreamDecoder


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI's API does
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = Field(default=None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(default=1, ge=1)
    ignore_eos: bool = False  # vLLM's extension: keep going past EOS until max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int]


# OpenAI fields we cannot honour: refused when set, rather than silently ignored.
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
               "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0)}


def refuse_unsupported(r: BaseModel) -> None:
    for name, defaults in UNSUPPORTED.items():
        v = (r.model_extra or {}).get(name)
        if v not in defaults:
            raise APIError(400, f"{name}={v!r} is not supported by this server", param=name)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that may be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        self.buf += piece
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class Metrics:
    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("exactspec_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("exactspec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated = Counter("exactspec_generated_tokens", "Tokens generated", registry=r)
        self.latency = Histogram("exactspec_request_latency_seconds", "Request latency", registry=r,
                                 buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
        self.ttft = Histogram("exactspec_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        Gauge("exactspec_running_sequences", "Sequences in the running batch", registry=r).set_function(
            lambda: engine.running)
        Gauge("exactspec_queued_requests", "Requests waiting for a slot", registry=r).set_function(
            lambda: engine.queued)
        Gauge("exactspec_draft_proposed_tokens", "Draft tokens proposed (finished requests)", registry=r).set_function(
            lambda: engine.stats.proposed)
        Gauge("exactspec_draft_accepted_tokens", "Draft tokens accepted (finished requests)", registry=r).set_function(
            lambda: engine.stats.accepted)
        Gauge("exactspec_cancelled_requests", "Requests ended early (disconnect, stop string)",
              registry=r).set_function(lambda: engine.stats.cancelled)
        Gauge("exactspec_acceptance_rate", "Accepted / proposed draft tokens", registry=r).set_function(
            lambda: engine.stats.accepted / engine.stats.proposed if engine.stats.proposed else 0.0)


class Generation:
    """One request's life on the event loop: submit, stream text pieces, cancel on disconnect."""

    def __init__(self, app: "Server", prompt: list[int], params: SamplingParams, max_new: int, stops: list[str],
                 ignore_eos: bool = False):
        self.app, self.loop = app, asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        eos = frozenset() if ignore_eos else frozenset(app.model.eos_token_ids)
        self.req = Request(prompt, params, max_new, eos, self._event)
        self.stops = stops
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    def _event(self, new: list[int], finish: str | None) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.q.put_nowait, (new, finish))

    async def pieces(self) -> AsyncIterator[str]:
        self.app.engine.submit(self.req)
        dec, stop = StreamDecoder(self.app.model.tokenizer), StopMatcher(self.stops)
        try:
            while True:
                new, finish = await self.q.get()
                if new:
                    self.completion_tokens += len(new)
                    text, hit = stop.feed(dec.push(new))
                    if text:
                        yield text
                    if hit:
                        self.finish_reason = "stop"
                        self.app.engine.cancel(self.req)
                        return
                if finish is not None:
                    if finish.startswith("error"):
                        raise APIError(500, f"generation failed: {finish}", "server_error")
                    text, hit = stop.feed(dec.flush())
                    text += "" if hit else stop.flush()
                    if text:
                        yield text
                    self.finish_reason = "stop" if hit else finish
                    return
        finally:
            if self.finish_reason is None:  # client went away (or an error): free the slot
                self.app.engine.cancel(self.req)
            else:
                m = self.app.metrics
                m.generated.inc(self.completion_tokens)
                m.latency.observe(time.perf_counter() - self.req.created)
                if self.req.first_token_at is not None:
                    m.ttft.observe(self.req.first_token_at - self.req.created)


class Server:
    def __init__(self, model: Model, name: str, drafter: Drafter | None = None, num_draft_tokens: int | str = 4,
                 max_batch: int = 8, max_queue: int = 64):
        if model.tokenizer is None:
            raise ExactSpecError(f"{model.folder}: serving needs tokenizer.json")
        self.model, self.name = model, name
        self.engine = Engine(model, drafter, num_draft_tokens, max_batch, max_queue)
        self.metrics = Metrics(self.engine)
        self.app = self._build()

    # -- helpers --------------------------------------------------------------------------------
    def _params(self, r: _Sampling, prompt_len: int, max_tokens: int | None) -> tuple[SamplingParams, int]:
        if r.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        if r.model is not None and r.model != self.name:
            raise APIError(404, f"The model '{r.model}' does not exist (this server serves '{self.name}')",
                           code="model_not_found", param="model")
        ctx = self.model.net.max_context
        if prompt_len >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens; the prompt has {prompt_len}",
                           param="prompt", code="context_length_exceeded")
        room = ctx - prompt_len
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                                f"completion)", param="max_tokens", code="context_length_exceeded")
        seed = r.seed if r.seed is not None else secrets.randbits(62)
        try:
            return SamplingParams(r.temperature, r.top_k, r.top_p, r.min_p, r.repetition_penalty, seed), max_tokens
        except InvalidArgumentError as e:
            raise APIError(400, str(e)) from None

    def _stops(self, r: _Sampling) -> list[str]:
        return [r.stop] if isinstance(r.stop, str) else list(r.stop or [])

    def _usage(self, prompt_len: int, g: Generation) -> dict:
        return {"prompt_tokens": prompt_len, "completion_tokens": g.completion_tokens,
                "total_tokens": prompt_len + g.completion_tokens}

    async def _respond(self, kind: str, r: _Sampling, prompt: list[int], max_tokens: int | None):
        refuse_unsupported(r)
        params, max_new = self._params(r, len(prompt), max_tokens)
        self.metrics.prompt_tokens.inc(len(prompt))
        g = Generation(self, prompt, params, max_new, self._stops(r), r.ignore_eos)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"

        def choice(text: str, finish: str | None, delta: bool) -> dict:
            if kind == "chat":
                body = {"delta": {"role": "assistant", "content": text} if delta else None,
                        "message": None if delta else {"role": "assistant", "content": text}}
                body = {k: v for k, v in body.items() if v is not None}
            else:
                body = {"text": text, "logprobs": None}
            return {"index": 0, **body, "finish_reason": finish}

        if not r.stream:
            text = "".join([p async for p in g.pieces()])
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": self.name,
                                 "choices": [choice(text, g.finish_reason, False)],
                                 "usage": self._usage(len(prompt), g)})
        pieces = g.pieces()
        first = await anext(pieces, None)  # errors before the first byte still get a status code
        chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        include_usage = bool((r.stream_options or {}).get("include_usage"))

        async def sse() -> AsyncIterator[bytes]:
            def event(payload: dict) -> bytes:
                return f"data: {json.dumps(payload)}\n\n".encode()
            try:
                if first is not None:
                    yield event({"id": rid, "object": chunk_obj, "created": created, "model": self.name,
                                 "choices": [choice(first, None, True)]})
                async for p in pieces:
                    yield event({"id": rid, "object": chunk_obj, "created": created, "model": self.name,
                                 "choices": [choice(p, None, True)]})
                yield event({"id": rid, "object": chunk_obj, "created": created, "model": self.name,
                             "choices": [choice("", g.finish_reason, True)]})
                if include_usage:
                    yield event({"id": rid, "object": chunk_obj, "created": created, "model": self.name,
                                 "choices": [], "usage": self._usage(len(prompt), g)})
                yield b"data: [DONE]\n\n"
            finally:
                await pieces.aclose()  # on disconnect this cancels the request and frees its slot

        return StreamingResponse(sse(), media_type="text/event-stream")

    # -- the app --------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="exactspec", docs_url=None, redoc_url=None)
        m = self.metrics

        @app.middleware("http")
        async def count(request: HTTPRequest, call_next):
            resp = await call_next(request)
            m.requests.labels(request.url.path, str(resp.status_code)).inc()
            return resp

        @app.exception_handler(RequestValidationError)
        async def invalid(_: HTTPRequest, exc: RequestValidationError):
            errs = exc.errors()
            e = errs[0] if errs else {}
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            msg = e.get("msg", "invalid request")
            if e.get("type") == "json_invalid":
                msg = f"request body is not valid JSON ({e.get('ctx', {}).get('error', msg)})"
            return JSONResponse(error_body(f"{where}: {msg}" if where else msg, "invalid_request_error",
                                           where or None), status_code=400)

        @app.exception_handler(APIError)
        async def api_error(_: HTTPRequest, exc: APIError):
            return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)

        @app.exception_handler(QueueFull)
        async def full(_: HTTPRequest, exc: QueueFull):
            return JSONResponse(error_body(f"server busy: {exc}; retry later", "rate_limit_error"), status_code=429,
                                headers={"Retry-After": "1"})

        @app.exception_handler(ExactSpecError)
        async def ours(_: HTTPRequest, exc: ExactSpecError):
            code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
            return JSONResponse(error_body(str(exc), "invalid_request_error", code=code), status_code=400)

        @app.exception_handler(HTTPException)
        async def http(_: HTTPRequest, exc: HTTPException):
            return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok", "running": self.engine.running, "queued": self.engine.queued}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(generate_latest(m.registry).decode(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0,
                                                "owned_by": "exactspec"}]}

        @app.post("/v1/completions")
        async def completions(r: CompletionRequest) -> Any:
            prompt = self.model.encode(r.prompt)
            return await self._respond("text", r, prompt, r.max_tokens if r.max_tokens is not None else 16)

        @app.post("/v1/chat/completions")
        async def chat_completions(r: ChatRequest) -> Any:
            messages = []
            for msg in r.messages:
                content = msg.content
                if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                    content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
                messages.append({"role": msg.role, "content": content or ""})
            text = chat.render(self.model.tokenizer.config, messages)
            prompt = self.model.tokenizer.encode(text, add_special_tokens=False)
            return await self._respond("chat", r, prompt, r.max_completion_tokens or r.max_tokens)

        return app


def serve(model: Model, name: str, host: str, port: int, drafter: Drafter | None, num_draft_tokens: int | str,
          max_batch: int, max_queue: int) -> None:
    import uvicorn
    s = Server(model, name, drafter, num_draft_tokens, max_batch, max_queue)
    try:
        uvicorn.run(s.app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)
    finally:
        s.engine.stop()
