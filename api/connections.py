"""HTTP connections whose request head must arrive in time (docs/api.md, "Limits").

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) and `api.limits` bounds a request
body, but nothing bounds the request head itself: a client that sends ``GET /health HTTP/1.1\\r\\n``
and then nothing ("slowloris") keeps its socket forever, and a few thousand of them use up the API's
open files. `HeaderTimeoutH11Protocol` is uvicorn's h11 protocol with one timer more: from the moment
a connection is made, and again each time a response completes and the connection waits for the next
request, the whole request head must arrive within ``header_read_timeout_s``
(``BATCHINFER_HEADER_READ_TIMEOUT_S``), else the connection is closed without an answer. The number of
connections is capped by uvicorn's ``limit_concurrency`` (``BATCHINFER_MAX_CONNECTIONS``): past it, a
request is answered 503.

Serve with ``uvicorn.run(..., http="api.connections:HeaderTimeoutH11Protocol")`` (``batchinfer api``).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from jobs.config import get_settings


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that closes a connection whose request head has not arrived within
    ``header_read_timeout_s`` seconds (the setting when None; a subclass may fix it, as tests do)."""

    header_read_timeout_s: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # the head is in (or the connection is done with)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # waiting for the next request's head on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        timeout_s = self.header_read_timeout_s
        if timeout_s is None:
            timeout_s = get_settings().header_read_timeout_s
        self._header_timer = self.loop.call_later(timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.logger.info("closing a connection whose request head did not arrive in time")
            self.transport.close()
