"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching engine.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming or not), /health,
/metrics (Prometheus). Errors are OpenAI-style JSON bodies; the server keeps serving. The `model`
field is matched against the served name only: nothing a client sends is ever opened as a file.
Wire shapes live in protocol.py; inputs are checked once, by Model.request (request.make_request).

Hardening (`ServeOptions`): an optional API key on /v1/* (and on /health, /metrics with
protect_metrics); a request-body limit (413); stop-string and rendered-template limits (400);
tokenizing and template rendering in worker threads, so /health answers while a big request is
prepared; one request's fault ends that request only (500 with an error id; a stream ends with an
error event and [DONE]); a dead engine makes /health and new requests 503 instead of hanging;
a non-streaming client that disconnects cancels its generation; /metrics labels routes by their
template; uvicorn with keep-alive and request-read timeouts and a connection limit.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import secrets
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..text import chat
from ..api import Model
from ..decode.drafters import Drafter
from .engine import Engine, EngineDown, Event, Job, QueueFull
from ..errors import ExactSpecError, InvalidRequest
from .protocol import (DONE, APIError, ChatRequest, CompletionRequest, Shapes, _Sampling, chat_logprobs,
                       completion_logprobs, error_body, refuse_unsupported, sse, usage, validation_message)
from ..decode.request import DraftLength, Request
from ..text.stream import StopMatcher, StreamDecoder

log = logging.getLogger("exactspec.server")
FAULT_MARKER = "EXACTSPEC_FAULT_MARKER"  # env var (tests, bench/load.py): prompts containing it fail in the engine


@dataclass(frozen=True)
class ServeOptions:
    """What `exactspec serve` lets an operator set; every limit answers with a clear 4xx."""
    max_batch: int = 8  # sequences decoded together
    max_queue: int = 64  # waiting requests before 429
    max_n: int = 8  # choices (n, best_of) per request
    logprobs_mode: str = "raw"  # "raw" or "processed" (after the sampling filters), as vLLM's flag
    api_key: str | None = None  # required as `Authorization: Bearer KEY` on /v1/*
    protect_metrics: bool = False  # the key on /health and /metrics too
    max_body_bytes: int = 1 << 20  # 413 above
    max_stops: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_prompt_chars: int = 1 << 20  # a rendered chat prompt's characters
    allowed_hosts: tuple[str, ...] = ()  # Host header values accepted (empty: any)
    max_connections: int = 512  # uvicorn's limit_concurrency: 503 above
    keep_alive: float = 5.0  # idle keep-alive connections close after this
    read_timeout: float = 15.0  # a request's headers and body must arrive within this

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
                raise InvalidRequest(f"--{f.name.replace('_', '-')} {v}: must be > 0", f.name)


class Metrics:
    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("exactspec_requests", "HTTP requests by route (template, not raw path) and status",
                                ["endpoint", "status"], registry=r)
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
        Gauge("exactspec_failed_requests", "Requests ended by an internal error (see the log by error id)",
              registry=r).set_function(lambda: engine.stats.failed)
        Gauge("exactspec_engine_alive", "1 while the decoding engine thread runs", registry=r).set_function(
            lambda: float(engine.alive))
        Gauge("exactspec_acceptance_rate", "Accepted / proposed draft tokens", registry=r).set_function(
            lambda: engine.stats.accepted / engine.stats.proposed if engine.stats.proposed else 0.0)


class Generation:
    """One request's life on the event loop: submit, stream text pieces, cancel on disconnect."""

    def __init__(self, app: "Server", req: Request, fail_on_purpose: bool = False):
        self.app, self.loop = app, asyncio.get_running_loop()
        self.q: asyncio.Queue[Event] = asyncio.Queue()
        self.job = Job(req, self._event, fail_on_purpose=fail_on_purpose)
        self.lp: list = []  # TokenLogprobs of the tokens received, when the request asks for them
        self.completion_tokens = 0  # tokens this client was given (up to a stop string)
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None

    def _event(self, ev: Event) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, ev)
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass

    async def _next(self) -> Event:
        """The engine's next event; never waits on a dead engine."""
        while True:
            try:
                return await asyncio.wait_for(self.q.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if not self.app.engine.alive:
                    raise APIError(503, "the decoding engine stopped; retry later", "server_error") from None

    async def pieces(self) -> AsyncIterator[str]:
        try:
            self.app.engine.submit(self.job)
        except EngineDown as e:
            raise APIError(503, f"{e}; retry later", "server_error") from None
        dec, stop = StreamDecoder(self.app.model.tokenizer), StopMatcher(list(self.job.req.stop))
        try:
            while True:
                ev = await self._next()
                if ev.tokens:
                    if self.first_token_at is None:
                        self.first_token_at = time.perf_counter()
                    self.completion_tokens += len(ev.tokens)
                    self.lp += ev.logprobs or []
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
                 opts: ServeOptions = ServeOptions()):
        if model.tokenizer is None:
            raise ExactSpecError(f"{model.folder}: serving needs a tokenizer (tokenizer.json or GGUF metadata)")
        self.model, self.name, self.opts = model, name, opts
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 0
        DraftLength(self.num_draft_tokens)  # a bad k fails at start, not in every request
        self.limits = dataclasses.replace(model.net.limits, max_stops=opts.max_stops,
                                          max_stop_chars=opts.max_stop_chars)
        self.fault_marker = os.environ.get(FAULT_MARKER) or None
        self.engine = Engine(model.net, drafter, opts.max_batch, opts.max_queue)  # the KV cache: checked to fit
        self.metrics = Metrics(self.engine)
        self.app = self._build()

    def _requests(self, r: _Sampling, prompt: list[int], max_tokens: int | None, count: int,
                  logprobs: int | None) -> list[Request]:
        """The validated Requests of one body (400 naming the field otherwise): `count` candidates,
        the i-th with seed + i (seed None: a fresh base, reported nowhere but reproducible per choice)."""
        base = r.seed if r.seed is not None else (secrets.randbits(62) if r.temperature else 0)
        return [self.model.request(prompt, max_tokens, ignore_eos=r.ignore_eos, temperature=r.temperature,
                                   top_k=r.top_k, top_p=r.top_p, min_p=r.min_p,
                                   repetition_penalty=r.repetition_penalty, seed=base + i, stop=r.stop,
                                   num_draft_tokens=self.num_draft_tokens, limits=self.limits, logprobs=logprobs,
                                   logprobs_mode=self.opts.logprobs_mode)
                for i in range(count)]

    def _check_body(self, r: _Sampling, best_of: int) -> None:
        refuse_unsupported(r)
        if not 1 <= r.n <= best_of <= self.opts.max_n:
            raise APIError(400, f"n={r.n}, best_of={best_of}: need 1 <= n <= best_of <= {self.opts.max_n}", param="n")
        if r.stream and best_of > r.n:
            raise APIError(400, "best_of > n cannot stream (the best are known only at the end)", param="best_of")
        if r.model is not None and r.model != self.name:
            raise APIError(404, f"The model '{r.model}' does not exist (this server serves '{self.name}')",
                           code="model_not_found", param="model")

    def _score(self, ids: list[int], top: int):
        """The prompt's token logprobs (scoring pass), serialized with the engine's forwards."""
        with self.engine.forward_lock:
            return self.model.score(ids[:1], ids[1:], top)

    def _token(self, t: int) -> str:
        return self.model.tokenizer.decode([t])

    def _chat_prompt(self, r: ChatRequest) -> list[int]:
        """Template rendering and tokenizing, in a worker thread (both can be slow)."""
        messages = [{"role": msg.role, "content": msg.text()} for msg in r.messages]
        text = chat.render(self.model.tokenizer.config, messages, max_chars=self.opts.max_prompt_chars)
        return self.model.tokenizer.encode(text, add_special_tokens=False)

    def _marked(self, text: str) -> bool:
        return self.fault_marker is not None and self.fault_marker in text

    def _logprobs(self, kind: str, lps: list, prompt_lps: list | None, prompt: list[int], offset: int) -> dict:
        """OpenAI's logprobs object for these TokenLogprobs (completions: the prompt's first, when echoed)."""
        def tops(x):
            return [(self._token(t), lp) for t, lp in x.top]
        if kind == "chat":
            return chat_logprobs([self._token(x.token) for x in lps], [x.logprob for x in lps], [tops(x) for x in lps])
        toks, vals, alts = [], [], []
        if prompt_lps is not None:  # echo: the first prompt token has no logprob (nothing before it)
            toks.append(self._token(prompt[0]))
            vals.append(None)
            alts.append(None)
        for x in (prompt_lps or []) + lps:
            toks.append(self._token(x.token))
            vals.append(x.logprob)
            alt: dict = {}
            for t, v in tops(x):  # ids that decode to the same text share a key: the likelier one stays
                alt.setdefault(t, v)
            alts.append(alt)
        return completion_logprobs(toks, vals, alts, offset)

    async def _respond(self, kind: str, r: _Sampling, reqs: list[Request], http: HTTPRequest, fail: bool,
                       want_lp: bool = False, echo: bool = False):
        prompt = list(reqs[0].prompt)
        self.metrics.prompt_tokens.inc(len(prompt))
        prompt_text = self.model.decode(prompt) if echo else ""
        prompt_lps = await asyncio.to_thread(self._score, prompt, reqs[0].logprobs or 0) if echo and want_lp else None
        shapes = Shapes(kind, ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex, int(time.time()),
                        self.name)
        if reqs[0].max_new_tokens == 0:  # scoring only (echo): nothing to generate
            lp = self._logprobs(kind, [], prompt_lps, prompt, 0) if want_lp else None
            return JSONResponse(shapes.whole([shapes.choice(prompt_text, "length", False, 0, lp)],
                                             usage(len(prompt), 0)))
        gens = [Generation(self, q, fail) for q in reqs]
        if not r.stream:
            task = asyncio.ensure_future(asyncio.gather(*[_collect(g.pieces()) for g in gens]))
            while not task.done():  # a client that hangs up cancels its generations and frees the slots
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await http.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return JSONResponse(error_body("client disconnected", "invalid_request_error"),
                                        status_code=499)
            texts = task.result()
            order = list(range(len(gens)))
            if len(gens) > r.n:  # best_of: the n candidates with the highest mean token logprob
                mean = [sum(x.logprob for x in g.lp) / max(1, len(g.lp)) for g in gens]
                order = sorted(order, key=lambda i: -mean[i])[: r.n]
            choices = [shapes.choice(prompt_text + texts[i], gens[i].finish_reason, False, j,
                                     self._logprobs(kind, gens[i].lp, prompt_lps, prompt, 0) if want_lp else None)
                       for j, i in enumerate(order)]
            return JSONResponse(shapes.whole(choices, usage(len(prompt), sum(g.completion_tokens for g in gens))))
        sent = [[0, len(prompt_text)] for _ in gens]  # per choice: logprobs sent, characters sent

        def chunk(i: int, text: str, finish: str | None = None) -> bytes:
            g, s = gens[i], sent[i]
            lp = None
            if want_lp:
                lp = self._logprobs(kind, g.lp[s[0]:], None, prompt, s[1])
                s[0] = len(g.lp)
            s[1] += len(text)
            return shapes.chunk(text, finish, logprobs=lp, index=i)

        def start() -> list[bytes]:
            if not echo:
                return []
            lp = self._logprobs(kind, [], prompt_lps, prompt, 0) if want_lp else None
            return [shapes.chunk(prompt_text, logprobs=lp, index=i) for i in range(len(gens))]

        def end() -> list[bytes]:
            tail = [shapes.chunk(usage=usage(len(prompt), sum(g.completion_tokens for g in gens)))] \
                if r.include_usage else []
            return tail + [DONE]

        if len(gens) == 1:
            g = gens[0]
            pieces = g.pieces()
            first = await anext(pieces, None)  # errors before the first byte still get a status code

            async def stream() -> AsyncIterator[bytes]:
                try:
                    for c in start():
                        yield c
                    if first is not None:
                        yield chunk(0, first)
                    async for p in pieces:
                        yield chunk(0, p)
                    yield chunk(0, "", g.finish_reason)
                    for c in end()[:-1]:
                        yield c
                except Exception as e:  # mid-stream: the status is sent; end with an error event
                    yield self._error_event(e)
                finally:
                    await pieces.aclose()  # on disconnect this cancels the request and frees its slot
                yield DONE
            return StreamingResponse(stream(), media_type="text/event-stream")

        async def many() -> AsyncIterator[bytes]:  # n choices interleaved, each chunk with its index
            q: asyncio.Queue = asyncio.Queue()

            async def pump(i: int) -> None:
                try:
                    async for p in gens[i].pieces():
                        await q.put((i, p, None))
                    await q.put((i, None, None))
                except Exception as e:
                    await q.put((i, None, e))
            tasks = [asyncio.ensure_future(pump(i)) for i in range(len(gens))]
            try:
                for c in start():
                    yield c
                left = len(gens)
                while left:
                    i, p, e = await q.get()
                    if e is not None:
                        yield self._error_event(e)
                        left -= 1
                    elif p is None:
                        yield chunk(i, "", gens[i].finish_reason)
                        left -= 1
                    else:
                        yield chunk(i, p)
                for c in end():
                    yield c
            finally:  # on disconnect: every choice's generation is cancelled
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return StreamingResponse(many(), media_type="text/event-stream")

    @staticmethod
    def _error_event(e: Exception) -> bytes:
        if isinstance(e, APIError):
            return sse(error_body(e.message, e.type, e.param, e.code))
        eid = uuid.uuid4().hex[:12]
        log.error("exactspec server: error %s in a stream", eid, exc_info=e)
        return sse(error_body(f"internal error (id {eid})", "server_error"))

    # -- the app --------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="exactspec", docs_url=None, redoc_url=None, openapi_url=None)
        m, opts = self.metrics, self.opts
        if opts.allowed_hosts:
            app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(opts.allowed_hosts))

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

        @app.exception_handler(chat.ChatTemplateBroken)
        async def broken(_: HTTPRequest, exc: chat.ChatTemplateBroken):
            return JSONResponse(error_body(str(exc), "server_error"), status_code=500)

        @app.exception_handler(ExactSpecError)
        async def ours(_: HTTPRequest, exc: ExactSpecError):
            return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

        @app.exception_handler(HTTPException)
        async def http(_: HTTPRequest, exc: HTTPException):
            return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def internal(_: HTTPRequest, exc: Exception):
            eid = uuid.uuid4().hex[:12]
            log.error("exactspec server: error %s", eid, exc_info=exc)
            return JSONResponse(error_body(f"internal error (id {eid}; the server log has the details)",
                                           "server_error"), status_code=500)

        @app.get("/health")
        async def health() -> JSONResponse:
            e = self.engine
            body = {"status": "ok" if e.alive else "engine stopped", "engine_alive": e.alive, "running": e.running,
                    "queued": e.queued, "max_queue": e.max_queue}
            return JSONResponse(body, status_code=200 if e.alive else 503)

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(generate_latest(m.registry).decode(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0,
                                                "owned_by": "exactspec"}]}

        @app.post("/v1/completions")
        async def completions(r: CompletionRequest, http: HTTPRequest) -> Any:
            best_of = r.best_of or r.n
            self._check_body(r, best_of)
            if r.logprobs is not None and r.logprobs < 0:
                raise APIError(400, f"logprobs={r.logprobs}: must be >= 0", param="logprobs")
            ids = await asyncio.to_thread(self.model.encode, r.prompt)
            internal = r.logprobs if r.logprobs is not None else (0 if best_of > r.n else None)  # best_of ranks by them
            reqs = await asyncio.to_thread(self._requests, r, ids, r.max_tokens if r.max_tokens is not None else 16,
                                           best_of, internal)
            fail = isinstance(r.prompt, str) and self._marked(r.prompt)
            return await self._respond("text", r, reqs, http, fail, r.logprobs is not None, r.echo)

        @app.post("/v1/chat/completions")
        async def chat_completions(r: ChatRequest, http: HTTPRequest) -> Any:
            self._check_body(r, r.n)
            if r.top_logprobs is not None and not r.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            prompt = await asyncio.to_thread(self._chat_prompt, r)
            reqs = await asyncio.to_thread(self._requests, r, prompt, r.max_completion_tokens or r.max_tokens, r.n,
                                           (r.top_logprobs or 0) if r.logprobs else None)
            fail = any(self._marked(msg.text()) for msg in r.messages)
            return await self._respond("chat", r, reqs, http, fail, r.logprobs)

        return Guard(BodyLimit(app, opts.max_body_bytes), opts, m)


async def _collect(pieces: AsyncIterator[str]) -> str:
    return "".join([p async for p in pieces])


class Guard:
    """ASGI middleware: the API key (401, constant-time compare) and the per-route request count
    (labelled by the matched route's template, never by the raw path a client sent)."""

    def __init__(self, app, opts: ServeOptions, metrics: Metrics):
        self.app, self.metrics, self.protect_all = app, metrics, opts.protect_metrics
        self.key = opts.api_key.encode() if opts.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def send_status(msg):
            if msg["type"] == "http.response.start":
                status.append(msg["status"])
            await send(msg)
        if self.key is not None and (scope["path"].startswith("/v1/") or self.protect_all):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                resp = JSONResponse(error_body("Incorrect API key provided (send Authorization: Bearer KEY)",
                                               "invalid_request_error", code="invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send_status)
                self.metrics.requests.labels("(unauthorized)", "401").inc()
                return
        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "(unmatched)")
            self.metrics.requests.labels(route, str(status[0] if status else 500)).inc()


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before the app parses any of it
    (by Content-Length, or by counting a chunked body as it arrives)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        too_big = length is not None and (not length.isdigit() or int(length) > self.limit)
        chunks, n = [], 0
        while not too_big:  # read the body (bounded) before the app sees it
            msg = await receive()
            if msg["type"] != "http.request":
                chunks.append(msg)
                break
            n += len(msg.get("body", b""))
            chunks.append(msg)
            too_big = n > self.limit
            if not msg.get("more_body"):
                break
        if too_big:
            resp = JSONResponse(error_body(f"request body exceeds {self.limit} bytes", "invalid_request_error"),
                                status_code=413)
            return await resp(scope, receive, send)

        async def replay():
            return chunks.pop(0) if chunks else await receive()
        await self.app(scope, replay, send)


def uvicorn_config(app, host: str, port: int, opts: ServeOptions):
    """uvicorn with the limits for slow or many clients: idle keep-alive and request-read timeouts,
    a connection limit (503 above), 16 KB of headers at most."""
    import uvicorn
    from .asgi import ReadTimeoutH11
    proto = type("ReadTimeoutH11", (ReadTimeoutH11,), {"read_timeout_s": opts.read_timeout})
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2,
                          timeout_keep_alive=max(1, round(opts.keep_alive)), limit_concurrency=opts.max_connections,
                          h11_max_incomplete_event_size=16 * 1024, http=proto)


def serve(model: Model, name: str, host: str, port: int, drafter: Drafter | None, num_draft_tokens: int | str,
          opts: ServeOptions = ServeOptions()) -> None:
    import uvicorn
    s = Server(model, name, drafter, num_draft_tokens, opts)
    print(f"exactspec: serving {name} ({model.folder}) on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn_config(s.app, host, port, opts)).run()
    finally:
        s.engine.stop()
