"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching engine.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming or not), /health,
/metrics (Prometheus). Errors are OpenAI-style JSON bodies with 4xx codes; the server keeps
serving. The `model` field is matched against the served name only: nothing a client sends is
ever opened as a file. Wire shapes live in protocol.py; inputs are checked once, by
Model.request (request.make_request).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException

from . import chat
from .api import Model
from .drafters import Drafter
from .engine import Engine, Event, Job, QueueFull
from .errors import ExactSpecError, InvalidRequest
from .protocol import (DONE, APIError, ChatRequest, CompletionRequest, Shapes, _Sampling, error_body,
                       refuse_unsupported, usage, validation_message)
from .request import DraftLength, Request
from .tokenizer import StopMatcher, StreamDecoder


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
        Gauge("exactspec_cancelled_tokens", "Tokens generated for requests that were then cancelled",
              registry=r).set_function(lambda: engine.stats.cancelled_tokens)
        Gauge("exactspec_acceptance_rate", "Accepted / proposed draft tokens", registry=r).set_function(
            lambda: engine.stats.accepted / engine.stats.proposed if engine.stats.proposed else 0.0)


class Generation:
    """One request's life on the event loop: submit, stream text pieces, cancel on disconnect."""

    def __init__(self, app: "Server", req: Request):
        self.app, self.loop = app, asyncio.get_running_loop()
        self.q: asyncio.Queue[Event] = asyncio.Queue()
        self.job = Job(req, self._event)
        self.completion_tokens = 0  # tokens this client was given (up to a stop string)
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None

    def _event(self, ev: Event) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.q.put_nowait, ev)

    async def pieces(self) -> AsyncIterator[str]:
        self.app.engine.submit(self.job)
        dec, stop = StreamDecoder(self.app.model.tokenizer), StopMatcher(list(self.job.req.stop))
        try:
            while True:
                ev = await self.q.get()
                if ev.tokens:
                    if self.first_token_at is None:
                        self.first_token_at = time.perf_counter()
                    self.completion_tokens += len(ev.tokens)
                    text, hit = stop.feed(dec.push(ev.tokens))
                    if text:
                        yield text
                    if hit:
                        self.finish_reason = "stop"
                        self.app.engine.cancel(self.job)
                        return
                if ev.error is not None:
                    raise APIError(500, str(ev.error), "server_error")
                if ev.finish_reason is not None:
                    text, hit = stop.feed(dec.flush())
                    text += "" if hit else stop.flush()
                    if text:
                        yield text
                    self.finish_reason = "stop" if hit else ev.finish_reason
                    return
        finally:
            if self.finish_reason is None:  # client went away (or an error): free the slot
                self.app.engine.cancel(self.job)
            else:
                m = self.app.metrics
                m.generated.inc(self.completion_tokens)
                m.latency.observe(time.perf_counter() - self.job.created)
                if self.first_token_at is not None:
                    m.ttft.observe(self.first_token_at - self.job.created)


class Server:
    def __init__(self, model: Model, name: str, drafter: Drafter | None = None, num_draft_tokens: int | str = 4,
                 max_batch: int = 8, max_queue: int = 64):
        if model.tokenizer is None:
            raise ExactSpecError(f"{model.folder}: serving needs a tokenizer (tokenizer.json or GGUF metadata)")
        self.model, self.name = model, name
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 0
        DraftLength(self.num_draft_tokens)  # a bad k fails at start, not in every request
        self.engine = Engine(model.net, drafter, max_batch, max_queue)
        self.metrics = Metrics(self.engine)
        self.app = self._build()

    def _request(self, r: _Sampling, prompt: str | list[int], max_tokens: int | None) -> Request:
        """The one validated Request for this body (400 naming the field otherwise)."""
        refuse_unsupported(r)
        if r.n != 1:
            raise APIError(400, f"n={r.n}: only n=1 is supported", param="n")
        if r.model is not None and r.model != self.name:
            raise APIError(404, f"The model '{r.model}' does not exist (this server serves '{self.name}')",
                           code="model_not_found", param="model")
        return self.model.request(prompt, max_tokens, ignore_eos=r.ignore_eos, temperature=r.temperature,
                                  top_k=r.top_k, top_p=r.top_p, min_p=r.min_p, repetition_penalty=r.repetition_penalty,
                                  seed=r.seed, stop=r.stop, num_draft_tokens=self.num_draft_tokens)

    async def _respond(self, kind: str, r: _Sampling, req: Request):
        self.metrics.prompt_tokens.inc(len(req.prompt))
        g = Generation(self, req)
        shapes = Shapes(kind, ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex, int(time.time()),
                        self.name)
        n_prompt = len(req.prompt)
        if not r.stream:
            text = "".join([p async for p in g.pieces()])
            return JSONResponse(shapes.whole(text, g.finish_reason, usage(n_prompt, g.completion_tokens)))
        pieces = g.pieces()
        first = await anext(pieces, None)  # errors before the first byte still get a status code

        async def sse() -> AsyncIterator[bytes]:
            try:
                if first is not None:
                    yield shapes.chunk(first)
                async for p in pieces:
                    yield shapes.chunk(p)
                yield shapes.chunk("", g.finish_reason)
                if r.include_usage:
                    yield shapes.chunk(usage=usage(n_prompt, g.completion_tokens))
                yield DONE
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
            msg, where = validation_message(exc.errors())
            return JSONResponse(error_body(msg, "invalid_request_error", where), status_code=400)

        @app.exception_handler(InvalidRequest)
        async def invalid_request(_: HTTPRequest, exc: InvalidRequest):
            e = APIError.invalid(exc)
            return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

        @app.exception_handler(APIError)
        async def api_error(_: HTTPRequest, exc: APIError):
            return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)

        @app.exception_handler(QueueFull)
        async def full(_: HTTPRequest, exc: QueueFull):
            return JSONResponse(error_body(f"server busy: {exc}; retry later", "rate_limit_error"), status_code=429,
                                headers={"Retry-After": "1"})

        @app.exception_handler(ExactSpecError)
        async def ours(_: HTTPRequest, exc: ExactSpecError):
            return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

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
            req = self._request(r, r.prompt, r.max_tokens if r.max_tokens is not None else 16)
            return await self._respond("text", r, req)

        @app.post("/v1/chat/completions")
        async def chat_completions(r: ChatRequest) -> Any:
            messages = [{"role": msg.role, "content": msg.text()} for msg in r.messages]
            text = chat.render(self.model.tokenizer.config, messages)
            prompt = self.model.tokenizer.encode(text, add_special_tokens=False)
            return await self._respond("chat", r, self._request(r, prompt, r.max_completion_tokens or r.max_tokens))

        return app


def serve(model: Model, name: str, host: str, port: int, drafter: Drafter | None, num_draft_tokens: int | str,
          max_batch: int, max_queue: int) -> None:
    import uvicorn
    s = Server(model, name, drafter, num_draft_tokens, max_batch, max_queue)
    try:
        uvicorn.run(s.app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)
    finally:
        s.engine.stop()
