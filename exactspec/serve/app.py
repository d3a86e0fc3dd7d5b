"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching engine.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming or not), /health,
/metrics (Prometheus). Errors are OpenAI-style JSON bodies; the server keeps serving. The `model`
field is matched against the served name only: nothing a client sends is ever opened as a file.
Wire shapes live in protocol.py, a response's assembly in respond.py, the
ASGI guards and uvicorn's setup in asgi.py, the options in options.py; inputs are checked once, by Model.request (request.make_request).

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
import hashlib
import json
import logging
import secrets
import sys
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..api import Model
from ..decode.constraint import Grammar
from ..decode.drafters import Drafter
from ..decode.request import DraftLength, Request
from ..errors import ExactSpecError, InvalidRequest
from ..text import chat
from .asgi import BodyLimit, DrainingServer, Guard, uvicorn_config
from .engine import Engine, EngineDown, QueueFull
from .metrics import Metrics
from .options import ServeOptions
from .protocol import (APIError, ChatRequest, CompletionRequest, _Sampling, error_body, refuse_unsupported, usage,
                       validation_message)
from .respond import Reply
from . import tools

log = logging.getLogger("exactspec.server")


class Server:
    def __init__(self, model: Model, name: str, drafter: Drafter | None = None, num_draft_tokens: int | str = "auto",
                 opts: ServeOptions = ServeOptions()):
        if model.tokenizer is None:
            raise ExactSpecError(f"{model.folder}: serving needs a tokenizer (tokenizer.json or GGUF metadata)")
        self.model, self.name, self.opts = model, name, opts
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 0
        self.forced_k = num_draft_tokens  # constrained requests draft the text their grammar forces, drafter or not
        DraftLength(num_draft_tokens)  # a bad k fails at start, not in every request
        self.limits = dataclasses.replace(model.net.limits, max_stops=opts.max_stops,
                                          max_stop_chars=opts.max_stop_chars)
        self.engine = Engine(model.net, drafter, opts.max_batch, opts.max_queue,  # the KV cache: checked to fit
                             opts.prefill_chunk, opts.prefix_cache_mb * (1 << 20) // model.net.block_bytes,
                             opts.draft_branches)
        self.metrics = Metrics(self.engine)
        self.draining_since: float | None = None  # monotonic time of the shutdown signal
        self.app = self._build()

    # -- shutdown -------------------------------------------------------------------------------
    def drain(self) -> None:
        """A shutdown signal arrived: admit nothing new (503), let in-flight requests finish for
        `shutdown_grace` seconds, then end each (a stream with an error event and [DONE], a waiting
        non-streaming request with a JSON 503)."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            log.warning("exactspec server: shutting down; in-flight requests have %.0f s", self.opts.shutdown_grace)

    def drain_left(self) -> float | None:
        """Seconds of grace left (None: not shutting down)."""
        if self.draining_since is None:
            return None
        return self.opts.shutdown_grace - (time.monotonic() - self.draining_since)

    def _scope(self, r: _Sampling, http: HTTPRequest) -> str:
        """Who may share prefix-cache blocks with this request: the same salt (and, when the operator
        asks, the same Authorization header). Hashed: the scope is kept in memory."""
        auth = http.headers.get("authorization", "") if self.opts.prefix_cache_scope == "authorization" else ""
        return hashlib.sha256(f"{len(auth)}:{auth}|{r.cache_salt or ''}".encode()).hexdigest() if auth or r.cache_salt \
            else ""

    def _requests(self, r: _Sampling, prompt: list[int], max_tokens: int | None, count: int,
                  logprobs: int | None, scope: str = "", name: str = "prompt", prediction: str = "",
                  constraint: Grammar | None = None) -> list[Request]:
        """The validated Requests of one body (400 naming the field otherwise): `count` candidates,
        the i-th with seed + i (seed None: a fresh base, reported nowhere but reproducible per choice)."""
        base = r.seed if r.seed is not None else (secrets.randbits(62) if r.temperature else 0)
        params = r.params()
        return [self.model.request(prompt, max_tokens, params=dataclasses.replace(params, seed=base + i),
                                   ignore_eos=r.ignore_eos, stop=r.stop, limits=self.limits,
                                   num_draft_tokens=self.num_draft_tokens if constraint is None else self.forced_k,
                                   logprobs=logprobs, logprobs_mode=self.opts.logprobs_mode,
                                   cache_scope=scope, name=name, prediction=prediction, constraint=constraint)
                for i in range(count)]

    def _check_body(self, r: _Sampling, best_of: int) -> None:
        refuse_unsupported(r)
        if not 1 <= r.n <= best_of <= self.opts.max_n:
            raise APIError(400, f"n={r.n}, best_of={best_of}: need 1 <= n <= best_of <= {self.opts.max_n}",
                           param="best_of" if 1 <= r.n <= self.opts.max_n else "n")
        if r.stream and best_of > r.n:
            raise APIError(400, "best_of > n cannot stream (the best are known only at the end)", param="best_of")
        if r.model is not None and r.model != self.name:
            raise APIError(404, f"The model '{r.model}' does not exist (this server serves '{self.name}')",
                           code="model_not_found", param="model")

    async def _score(self, ids: list[int], top: int):
        """The prompt's token logprobs: scored in chunks of `prefill_chunk` rows, each run by the engine
        thread between two of its steps (as a prompt's prefill is), so other requests wait one chunk."""
        steps = self.model.score_steps(ids[:1], ids[1:], top, self.opts.prefill_chunk)
        out: list = []
        while True:
            try:
                fut = self.engine.call(lambda: next(steps, None))
            except EngineDown as e:
                raise APIError(503, f"{e}; retry later", "server_error") from None
            part = await asyncio.wrap_future(fut)
            if part is None:
                return out
            out += part

    def _chat_prompt(self, r: ChatRequest, tp: tools.ToolPlan | None, cancelled=None) -> list[int]:
        """Template rendering and tokenizing, in a worker thread (both can be slow); `cancelled()`
        true stops the rendering (the client left)."""
        messages, offered = tools.messages(r, tp, chat.template_source(self.model.tokenizer.config) or "")
        text = chat.render(self.model.tokenizer.config, messages, max_chars=self.opts.max_prompt_chars,
                           cancelled=cancelled, tools=offered)
        return self.model.encode_text(text)

    async def _while_connected(self, http: HTTPRequest, fn, *args):
        """fn(*args, cancelled) in a worker thread; cancelled() turns true once the client hangs up."""
        left = threading.Event()

        async def watch() -> None:
            while not left.is_set():
                await asyncio.sleep(0.25)
                if await http.is_disconnected():
                    left.set()
        watcher = asyncio.ensure_future(watch())
        try:
            return await asyncio.to_thread(fn, *args, left.is_set)
        finally:
            watcher.cancel()

    async def _respond(self, kind: str, r: _Sampling, reqs: list[Request], http: HTTPRequest,
                       want_lp: bool = False, echo: bool = False, tp: tools.ToolPlan | None = None):
        self.metrics.prompt_tokens.inc(len(reqs[0].prompt))
        prompt_lps = None
        if echo and want_lp:
            prompt_lps = await self._score(list(reqs[0].prompt), reqs[0].logprobs or 0)
        return await Reply(self, kind, r, reqs, want_lp, echo, prompt_lps, tp).send(http)

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
            ok = e.alive and self.draining_since is None
            status = "ok" if ok else "shutting down" if self.draining_since is not None else "engine stopped"
            body = {"status": status, "engine_alive": e.alive, "running": e.running, "queued": e.queued,
                    "max_queue": e.max_queue}
            return JSONResponse(body, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(generate_latest(m.registry).decode(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0,
                                                "owned_by": "exactspec"}]}

        @app.post("/v1/completions")
        async def completions(r: CompletionRequest, http: HTTPRequest) -> Any:
            best_of = r.best_of if r.best_of is not None else r.n
            self._check_body(r, best_of)
            if r.logprobs is not None and r.logprobs < 0:
                raise APIError(400, f"logprobs={r.logprobs}: must be >= 0", param="logprobs")
            prompts = r.prompts()
            if len(prompts) > self.opts.max_prompts:
                raise APIError(400, f"prompt: {len(prompts)} prompts; at most {self.opts.max_prompts} per request",
                               param="prompt")
            if len(prompts) > 1 and r.receipt:
                raise APIError(400, "receipt with several prompts is not supported: send one prompt per request",
                               param="receipt")
            if len(prompts) > 1 and r.stream:
                raise APIError(400, "stream with several prompts is not supported: send one prompt per request "
                               "(or stream=false)", param="stream")
            internal = r.logprobs if r.logprobs is not None else (0 if best_of > r.n else None)  # best_of ranks by them
            scope = self._scope(r, http)
            g = await asyncio.to_thread(tools.constraint, self.model, r, None)

            async def one(i: int, prompt):
                ids = await asyncio.to_thread(self.model.encode, prompt)
                reqs = await asyncio.to_thread(self._requests, r, ids, r.max_tokens if r.max_tokens is not None
                                               else 16, best_of, internal, scope, "prompt" if i is None else
                                               f"prompt {i}", constraint=g)
                return await self._respond("text", r, reqs, http, r.logprobs is not None, r.echo)
            if len(prompts) == 1:
                return await one(None, prompts[0])
            return _merge(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]), r.n)

        @app.post("/v1/chat/completions")
        async def chat_completions(r: ChatRequest, http: HTTPRequest) -> Any:
            self._check_body(r, r.n)
            if r.top_logprobs is not None and not r.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            tp = tools.plan(r)
            tools.check_history(r.messages)
            g = await asyncio.to_thread(tools.constraint, self.model, r, tp)
            prompt = await self._while_connected(http, self._chat_prompt, r, tp)
            limit = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens  # 0 is a limit
            predicted = r.predicted()
            if len(predicted) > self.opts.max_prompt_chars:
                raise APIError(400, f"prediction: more than {self.opts.max_prompt_chars} characters", param="prediction")
            reqs = await asyncio.to_thread(self._requests, r, prompt, limit, r.n,
                                           (r.top_logprobs or 0) if r.logprobs else None, self._scope(r, http),
                                           prediction=predicted, constraint=g)
            return await self._respond("chat", r, reqs, http, r.logprobs, tp=tp)

        return Guard(BodyLimit(app, opts.max_body_bytes), opts, m, lambda: self.draining_since is not None)


def _merge(replies: list, n: int):
    """One completions body from the replies to each prompt of a batch: choices numbered on (prompt i's
    j-th choice is i * n + j, as OpenAI's API), usage summed; the first failure answers for all."""
    bad = next((x for x in replies if x.status_code != 200), None)
    if bad is not None:
        return bad
    bodies = [json.loads(x.body) for x in replies]
    out = dict(bodies[0], choices=[dict(c, index=i * n + c["index"]) for i, b in enumerate(bodies)
                                   for c in b["choices"]])
    u = [b["usage"] for b in bodies]
    out["usage"] = usage(sum(x["prompt_tokens"] for x in u), sum(x["completion_tokens"] for x in u),
                         sum(x["prompt_tokens_details"]["cached_tokens"] for x in u))
    return JSONResponse(out)


def serve(model: Model, name: str, host: str, port: int, drafter: Drafter | None, num_draft_tokens: int | str,
          opts: ServeOptions = ServeOptions()) -> None:
    s = Server(model, name, drafter, num_draft_tokens, opts)
    print(f"exactspec: serving {name} ({model.folder}) on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    try:
        DrainingServer(uvicorn_config(s.app, host, port, opts), s.drain).run()
    finally:
        s.engine.stop()
