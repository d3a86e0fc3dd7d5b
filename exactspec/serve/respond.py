"""One request's answer on the event loop: `Generation` (one choice: submit to the engine, receive
text pieces, cancel on disconnect) and `Reply` (the response of one body, in one of three shapes:
`scored` when there is nothing to generate (echo with max_tokens 0), `whole` (collected, n choices,
best_of) or `stream` (SSE; several choices interleaved with their index))."""
from __future__ import annotations

import asyncio
import difflib
import logging
import time
import uuid
from typing import AsyncIterator, Protocol

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from .. import receipt
from ..api import Model
from ..decode.request import Request
from ..decode.sampling import TokenLogprob
from ..errors import ConstraintError
from ..text.stream import StopCut
from .engine import Engine, EngineDown, Event, Job
from .metrics import Metrics
from . import tools
from .protocol import DONE, APIError, Shapes, _Sampling, chat_logprobs, completion_logprobs, error_body, sse, usage

log = logging.getLogger("exactspec.server")


class Server(Protocol):
    """What a response needs of the server (app.Server is one)."""
    model: Model
    name: str
    engine: Engine
    metrics: Metrics

    def drain_left(self) -> float | None: ...


class Generation:
    """One request's life on the event loop: submit, stream text pieces, cancel on disconnect."""

    def __init__(self, app: Server, req: Request):
        self.app, self.loop = app, asyncio.get_running_loop()
        self.q: asyncio.Queue[Event] = asyncio.Queue()
        self.job = Job(req, self._event)
        self.lp: list = []  # TokenLogprobs of the tokens received, when the request asks for them
        self.tokens: list[int] = []  # the tokens this client was given (through the one that ends a stop string)
        self.cached_tokens = 0  # prompt tokens that came from the prefix cache
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def predicted(self) -> tuple[int, int]:
        """The prediction's tokens that appear in the answer, and those that do not (OpenAI's
        accepted/rejected_prediction_tokens): matched by difflib on the two token lists, so the count
        is a function of the request and its answer, never of how the drafts went."""
        pred = self.job.req.prediction
        if not pred:
            return 0, 0
        match = difflib.SequenceMatcher(None, pred, self.tokens, autojunk=False)
        same = sum(b.size for b in match.get_matching_blocks())
        return same, len(pred) - same

    def _event(self, ev: Event) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, ev)
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass

    async def _next(self) -> Event:
        """The engine's next event; never waits on a dead engine, nor past a shutdown's grace period."""
        while True:
            left = self.app.drain_left()
            if left is not None and left <= 0:
                raise APIError(503, "the server is shutting down; retry (on another replica)", "server_error")
            try:
                return await asyncio.wait_for(self.q.get(), timeout=1.0 if left is None else min(1.0, left))
            except asyncio.TimeoutError:
                if not self.app.engine.alive:
                    raise APIError(503, "the decoding engine stopped; retry later", "server_error") from None

    async def pieces(self) -> AsyncIterator[str]:
        try:
            self.app.engine.submit(self.job)
        except EngineDown as e:
            raise APIError(503, f"{e}; retry later", "server_error") from None
        cut = StopCut(self.app.model.tokenizer, list(self.job.req.stop))
        try:
            while True:
                ev = await self._next()
                if ev.tokens:
                    if self.first_token_at is None:
                        self.first_token_at = time.perf_counter()
                    text, used, hit = cut.feed(ev.tokens)
                    self.tokens += ev.tokens[:used]
                    self.lp += (ev.logprobs or [])[:used]
                    if text:
                        yield text
                    if hit:
                        self.finish_reason = "stop"
                        self.app.engine.cancel(self.job)
                        return
                if isinstance(ev.error, ConstraintError):  # the constraint met a limit of the matcher
                    raise APIError(400, str(ev.error), param=ev.error.field)
                if ev.error is not None:
                    raise APIError(500, str(ev.error), "server_error")
                if ev.finish_reason is not None:
                    if ev.stats is not None:
                        self.cached_tokens = ev.stats.cached_tokens
                    text, hit = cut.finish()
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




async def _collect(pieces: AsyncIterator[str]) -> str:
    return "".join([p async for p in pieces])




class Reply:
    """The response to one body: `kind` "text" (completions) or "chat"; `reqs` its choices'
    Requests (n, or best_of candidates); `prompt_lps` the echoed prompt's logprobs, when asked."""

    def __init__(self, app: Server, kind: str, r: _Sampling, reqs: list[Request], want_lp: bool, echo: bool,
                 prompt_lps: list[TokenLogprob] | None, tp: tools.ToolPlan | None = None):
        self.app, self.kind, self.r, self.reqs, self.want_lp = app, kind, r, reqs, want_lp
        self.tp = tp if tp is not None and tp.parse else None  # answers read for tool calls
        self.prompt = list(reqs[0].prompt)
        self.prompt_text = app.model.decode(self.prompt) if echo else ""
        self.echo, self.prompt_lps = echo, prompt_lps
        self.shapes = Shapes(kind, ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex, int(time.time()),
                             app.name, r.obfuscate)

    async def send(self, http: HTTPRequest):
        if self.r.receipt:  # the model file hashed once (cached by path, size, mtime), off the event loop
            await asyncio.to_thread(receipt.model_facts, self.app.model)
        if self.reqs[0].max_new_tokens == 0:  # scoring only (echo): nothing to generate
            return self.scored()
        gens = [Generation(self.app, q) for q in self.reqs]
        return await (self.stream(gens) if self.r.stream else self.whole(gens, http))

    # -- the three shapes -----------------------------------------------------------------------
    def scored(self) -> JSONResponse:
        lp = self._logprobs([], self.prompt_lps, 0) if self.want_lp else None
        body = self.shapes.whole([self.shapes.choice(self.prompt_text, "length", False, 0, lp)],
                                 usage(len(self.prompt), 0))
        if self.r.receipt:
            body["receipt"] = receipt.make(self.app.model, self.reqs[0], [(self.reqs[0].params.seed, [], "length")])
        return JSONResponse(body)

    async def whole(self, gens: list[Generation], http: HTTPRequest) -> JSONResponse:
        task = asyncio.ensure_future(asyncio.gather(*[_collect(g.pieces()) for g in gens]))
        while not task.done():  # a client that hangs up cancels its generations and frees the slots
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)
        texts = task.result()
        order = list(range(len(gens)))
        if len(gens) > self.r.n:  # best_of: the n candidates with the highest mean token logprob
            mean = [sum(x.logprob for x in g.lp) / max(1, len(g.lp)) for g in gens]
            order = sorted(order, key=lambda i: -mean[i])[: self.r.n]
        choices = []
        for j, i in enumerate(order):
            text, calls, finish = self._calls(self.prompt_text + texts[i], gens[i].finish_reason)
            choices.append(self.shapes.choice(text, finish, False, j, self._logprobs(gens[i].lp, self.prompt_lps, 0)
                                              if self.want_lp else None, calls))
        body = self.shapes.whole(choices, _usage(self.prompt, gens))
        if self.r.receipt:
            body["receipt"] = self.receipt([gens[i] for i in order])
        return JSONResponse(body)

    def _calls(self, text: str, finish: str | None) -> tuple[str | None, list[dict] | None, str | None]:
        """An answer as (content, tool_calls, finish_reason): read for calls where tools are offered."""
        if self.tp is None:
            return text, None, finish
        content, calls = tools.calls(text, self.tp, cut=finish == "length")
        if not calls:
            return content, None, finish
        return content, calls, "tool_calls" if finish == "stop" else finish  # cut by max_tokens: "length" stays

    def receipt(self, gens: list[Generation]) -> dict:
        """The receipt of these choices (in their order): each with its seed, tokens and finish reason."""
        return receipt.make(self.app.model, self.reqs[0],
                            [(g.job.req.params.seed, g.tokens, g.finish_reason or "error") for g in gens])

    async def stream(self, gens: list[Generation]) -> StreamingResponse:
        chunks = _Chunks(self, gens)
        if self.tp is not None:  # calls are known only once the text is whole: each choice in one chunk
            return StreamingResponse(self._whole_chunks(chunks, gens), media_type="text/event-stream")
        if len(gens) == 1:
            pieces = gens[0].pieces()
            first = await anext(pieces, None)  # errors before the first byte still get a status code
            return StreamingResponse(self._one(chunks, gens[0], pieces, first), media_type="text/event-stream")
        return StreamingResponse(self._many(chunks, gens), media_type="text/event-stream")

    # -- streaming ------------------------------------------------------------------------------
    async def _one(self, chunks: "_Chunks", g: Generation, pieces: AsyncIterator[str],
                   first: str | None) -> AsyncIterator[bytes]:
        try:
            for c in chunks.start():
                yield c
            if first is not None:
                yield chunks.chunk(0, first)
            async for p in pieces:
                yield chunks.chunk(0, p)
            yield chunks.chunk(0, "", g.finish_reason)
            for c in chunks.end()[:-1]:
                yield c
        except Exception as e:  # mid-stream: the status is sent; end with an error event
            yield error_event(e)
        finally:
            await pieces.aclose()  # on disconnect this cancels the request and frees its slot
        yield DONE

    async def _whole_chunks(self, chunks: "_Chunks", gens: list[Generation]) -> AsyncIterator[bytes]:
        """Tools offered: each choice's answer collected, then sent as its content or its tool-call deltas."""
        task = asyncio.ensure_future(asyncio.gather(*[_collect(g.pieces()) for g in gens]))
        try:
            texts = await task
            for i, (g, text) in enumerate(zip(gens, texts)):
                content, calls, finish = self._calls(text, g.finish_reason)
                if calls or content:  # one delta with all of the message: its content and its calls
                    yield chunks.chunk(i, content, tool_calls=calls)
                yield chunks.chunk(i, "", finish)
            for c in chunks.end()[:-1]:
                yield c
        except Exception as e:
            yield error_event(e)
        finally:  # on disconnect: every choice's generation is cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        yield DONE

    async def _many(self, chunks: "_Chunks", gens: list[Generation]) -> AsyncIterator[bytes]:
        """n choices interleaved, each chunk with its index."""
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
            for c in chunks.start():
                yield c
            left = len(gens)
            while left:
                i, p, e = await q.get()
                if e is not None:
                    yield error_event(e)
                    left -= 1
                elif p is None:
                    yield chunks.chunk(i, "", gens[i].finish_reason)
                    left -= 1
                else:
                    yield chunks.chunk(i, p)
            for c in chunks.end():
                yield c
        finally:  # on disconnect: every choice's generation is cancelled
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- logprobs -------------------------------------------------------------------------------
    def _token(self, t: int) -> str:
        return self.app.model.tokenizer.decode([t])

    def _logprobs(self, lps: list, prompt_lps: list | None, offset: int) -> dict:
        """OpenAI's logprobs object for these TokenLogprobs (completions: the prompt's first, when echoed)."""
        def tops(x):
            return [(self._token(t), lp) for t, lp in x.top]
        if self.kind == "chat":
            return chat_logprobs([self._token(x.token) for x in lps], [x.logprob for x in lps], [tops(x) for x in lps])
        toks, vals, alts = [], [], []
        if prompt_lps is not None:  # echo: the first prompt token has no logprob (nothing before it)
            toks.append(self._token(self.prompt[0]))
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


class _Chunks:
    """A stream's SSE chunks: what each choice has been sent (logprobs, characters) so far."""

    def __init__(self, reply: Reply, gens: list[Generation]):
        self.reply, self.gens = reply, gens
        self.sent = [[0, len(reply.prompt_text)] for _ in gens]  # per choice: logprobs sent, characters sent

    def chunk(self, i: int, text: str | None, finish: str | None = None, tool_calls: list[dict] | None = None) -> bytes:
        rp, g, s = self.reply, self.gens[i], self.sent[i]
        lp = None
        if rp.want_lp:
            lp = rp._logprobs(g.lp[s[0]:], None, s[1])
            s[0] = len(g.lp)
        s[1] += len(text or "")
        return rp.shapes.chunk(text, finish, logprobs=lp, index=i, tool_calls=tool_calls)

    def start(self) -> list[bytes]:
        rp = self.reply
        if not rp.echo:
            return []
        lp = rp._logprobs([], rp.prompt_lps, 0) if rp.want_lp else None
        return [rp.shapes.chunk(rp.prompt_text, logprobs=lp, index=i) for i in range(len(self.gens))]

    def end(self) -> list[bytes]:
        rp = self.reply
        tail = [rp.shapes.chunk(usage=_usage(rp.prompt, self.gens))] if rp.r.include_usage else []
        if rp.r.receipt:  # its own chunk, no choices, before [DONE]
            tail.append(rp.shapes.chunk(fields={"receipt": rp.receipt(self.gens)}))
        return tail + [DONE]


def _usage(prompt: list[int], gens: list[Generation]) -> dict:
    predicted = [g.predicted for g in gens]  # a difflib match each: once
    return usage(len(prompt), sum(g.completion_tokens for g in gens), gens[0].cached_tokens,
                 (sum(a for a, _ in predicted), sum(r for _, r in predicted)))


def error_event(e: Exception) -> bytes:
    if isinstance(e, APIError):
        return sse(error_body(e.message, e.type, e.param, e.code))
    eid = uuid.uuid4().hex[:12]
    log.error("exactspec server: error %s in a stream", eid, exc_info=e)
    return sse(error_body(f"internal error (id {eid})", "server_error"))
