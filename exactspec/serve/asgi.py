"""What sits between the socket and the app: uvicorn configured for slow or many clients
(`uvicorn_config`), its h11 protocol with a request-read timeout (`ReadTimeoutH11`), and two ASGI
middlewares: `Guard` (API key, per-route request counts) and `BodyLimit` (413).

ReadTimeoutH11 (slowloris): from the moment a connection opens, or a keep-alive connection's previous
response completes, the next request's headers and body must arrive within `read_timeout_s`, or the
connection is closed. (uvicorn's own timeout_keep_alive only runs between requests, once a first one
has completed.) It overrides hooks of uvicorn's H11Protocol, which is not public API: uvicorn is
pinned to the versions tested (pyproject.toml), and a uvicorn without these hooks fails at import
with a message saying so, not at the first slow client."""
from __future__ import annotations

import asyncio
import hmac
from typing import Callable

import uvicorn

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from .metrics import Metrics
from .options import ServeOptions
from .protocol import error_body

_HOOKS = ("connection_made", "handle_events", "on_response_complete", "connection_lost", "shutdown")
MAX_HEADER_BYTES = 16 * 1024  # the request line and headers (431 above)
DRAIN_BYTES = 64 << 20  # of a refused body, read and dropped before the 413 (a client that writes it all first)
_missing = [h for h in _HOOKS if not callable(getattr(H11Protocol, h, None))]
if _missing:  # pragma: no cover - an untested uvicorn
    raise ImportError(f"uvicorn's H11Protocol has no {', '.join(_missing)}: this uvicorn is not one exactspec's read "
                      "timeout supports (see the uvicorn pin in pyproject.toml)")


class ReadTimeoutH11(H11Protocol):
    read_timeout_s: float = 15.0
    linger_s: float = 2.0  # after a shutdown signal, before an idle keep-alive connection is closed

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        t = getattr(self, "_read_timer", None)
        if t is not None:
            t.cancel()
        self._read_timer = None

    def _in_flight(self) -> bool:
        """A whole request has arrived and its response is not complete: the app's time, not the client's."""
        c = self.cycle
        return c is not None and not c.response_complete and not c.more_body

    def _too_slow(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing() and not self._in_flight():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self._in_flight():
            self._disarm()  # the whole request is in: the app has it now

    def on_response_complete(self) -> None:
        self._arm()  # the next request on this connection has the same deadline (armed first: a
        super().on_response_complete()  # pipelined request handled inside disarms it again)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """A shutdown signal: an idle keep-alive connection stays open `linger_s` more, so a request
        already on its way gets the documented JSON 503 (Guard) rather than a closed socket; busy ones
        close after their response (uvicorn's own)."""
        if self.cycle is None or self.cycle.response_complete:
            self._disarm()
            self._read_timer = self.loop.call_later(self.linger_s, self._close_idle)
        else:
            super().shutdown()

    def _close_idle(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            super().shutdown()  # idle: closes now; a request in flight: closes after its response


class Guard:
    """ASGI middleware: the API key (401, constant-time compare) and the per-route request count
    (labelled by the matched route's template, never by the raw path a client sent)."""

    def __init__(self, app, opts: ServeOptions, metrics: Metrics, draining: Callable[[], bool] = lambda: False):
        self.app, self.metrics, self.protect_all, self.draining = app, metrics, opts.protect_metrics, draining
        self.key = opts.api_key.encode() if opts.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []
        heads = scope.get("headers") or []
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + \
            sum(len(k) + len(v) + 4 for k, v in heads)
        if size > MAX_HEADER_BYTES:  # h11's own limit bites only on headers split across reads
            resp = JSONResponse(error_body(f"request line and headers exceed {MAX_HEADER_BYTES} bytes",
                                           "invalid_request_error"), status_code=431, headers={"Connection": "close"})
            await _refuse(resp, scope, receive, send)
            self.metrics.requests.labels("(headers too large)", "431").inc()
            return

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
                await _refuse(resp, scope, receive, send_status)
                self.metrics.requests.labels("(unauthorized)", "401").inc()
                return
        if self.draining() and scope["path"].startswith("/v1/"):  # shutting down: nothing new is admitted
            resp = JSONResponse(error_body("the server is shutting down; retry (on another replica)", "server_error"),
                                status_code=503, headers={"Connection": "close", "Retry-After": "1"})
            await _refuse(resp, scope, receive, send_status)
            self.metrics.requests.labels("(shutting down)", "503").inc()
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
                                status_code=413, headers={"Connection": "close"})
            return await _refuse(resp, scope, receive, send, chunks, DRAIN_BYTES - n)

        async def replay():
            return chunks.pop(0) if chunks else await receive()
        await self.app(scope, replay, send)


async def _refuse(resp, scope, receive, send, seen: list | None = None, budget: int = DRAIN_BYTES) -> None:
    """Answer a request refused before all of its body was read (`seen`: the body messages read so far):
    the rest is read and dropped first (up to `budget` bytes; not where the client waits for
    100-continue), so the answer is not lost to a reset when the connection closes under body bytes
    still arriving (a client that sends it all first)."""
    if dict(scope.get("headers") or []).get(b"expect", b"").lower() != b"100-continue":
        await _drain(receive, budget, seen or [])
    await resp(scope, receive, send)


async def _drain(receive, budget: int, seen: list) -> None:
    """Read and drop a refused body (up to `budget` bytes) so the 413 is not lost to a reset: a
    socket closed with unread data answers the client's further writes with RST (nginx's lingering
    close does the same). The read timeout bounds the time."""
    if seen and (seen[-1].get("type") != "http.request" or not seen[-1].get("more_body")):
        return  # the whole body is in already
    while budget > 0:
        msg = await receive()
        if msg["type"] != "http.request":
            return
        budget -= len(msg.get("body", b""))
        if not msg.get("more_body"):
            return


def uvicorn_config(app, host: str, port: int, opts: ServeOptions):
    """uvicorn with the limits for slow or many clients: idle keep-alive and request-read timeouts,
    a connection limit (503 above), 16 KB of headers at most."""
    proto = type("ReadTimeoutH11", (ReadTimeoutH11,), {"read_timeout_s": opts.read_timeout})
    return uvicorn.Config(app, host=host, port=port, log_level="warning",
                          timeout_graceful_shutdown=opts.shutdown_grace + 5,  # our drain ends streams before it
                          timeout_keep_alive=max(1, round(opts.keep_alive)), limit_concurrency=opts.max_connections,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, http=proto)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app when a shutdown signal (SIGTERM, SIGINT) arrives: uvicorn
    stops listening and waits for open requests; `on_exit` (Server.drain) gives them their grace
    period and then ends each cleanly, before uvicorn would cancel them mid-response."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)
