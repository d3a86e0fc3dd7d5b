"""uvicorn's h11 protocol with a request-read timeout (slowloris): from the moment a connection
opens, or a keep-alive connection's previous response completes, the next request's headers and
body must arrive within `read_timeout_s`, or the connection is closed. (uvicorn's own
timeout_keep_alive only runs between requests, once a first one has completed.)"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class ReadTimeoutH11(H11Protocol):
    read_timeout_s: float = 15.0

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
