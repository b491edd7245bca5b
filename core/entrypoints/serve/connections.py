"""Connections that send nothing, or their headers or body a byte at a time, are closed after a deadline.

uvicorn times out a kept-alive connection only after a response, and any
byte received restarts that timer; a client that opens connections and
sends nothing (or trickles header bytes) holds them, and their descriptors,
forever.  :func:`protocol_with_header_deadline` gives uvicorn's h11 protocol
one more timer: each request's headers must be complete within
``server.header_timeout`` seconds of the connection opening or the previous
response ending (plus ``server.idle_timeout`` then), else the connection is
closed.  A body then gets the same ``server.header_timeout`` of grace, after
which it must keep up ``server.min_body_rate`` bytes per second on average
(checked each second; not while the server itself has paused reading it),
else the connection is closed: 300 clients trickling a byte every two
seconds would otherwise hold their connections forever.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


BODY_CHECK_SECONDS = 1.0
"""How often a body's rate is checked."""


class _HeaderDeadlineProtocol(H11Protocol):
    header_timeout: float = 10.0
    idle_timeout: float = 5.0
    min_body_rate: float = 16384.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._body_check: asyncio.TimerHandle | None = None
        self._body_started = 0.0
        self._body_received = 0
        self._arm_header_deadline(self.header_timeout)

    def _arm_header_deadline(self, seconds: float) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(seconds, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is not h11.IDLE:  # this request's headers are complete
            self._disarm_header_deadline()
        if state is h11.SEND_BODY:
            if self._body_check is None:
                self._body_started, self._body_received = self.loop.time(), 0
                self._body_check = self.loop.call_later(BODY_CHECK_SECONDS, self._check_body_rate)
            self._body_received += len(data)

    def _check_body_rate(self) -> None:
        """Close a connection whose body falls behind ``min_body_rate`` after the grace; else look again later."""
        self._body_check = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        late = self.loop.time() - self._body_started - self.header_timeout
        behind = self._body_received < late * self.min_body_rate
        if behind and not self.flow.read_paused:
            self.transport.close()
            return
        if self.flow.read_paused:  # the app has not read what came: the client is not the slow one
            self._body_started += BODY_CHECK_SECONDS
        self._body_check = self.loop.call_later(BODY_CHECK_SECONDS, self._check_body_rate)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline(self.idle_timeout + self.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        if self._body_check is not None:
            self._body_check.cancel()
            self._body_check = None
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol_with_header_deadline(
    header_timeout: float, idle_timeout: float, min_body_rate: float = 16384.0
) -> type[H11Protocol]:
    """uvicorn's h11 protocol class, closing connections whose headers are not complete within the deadline or
    whose body falls behind ``min_body_rate`` bytes per second (see the module)."""
    return type(
        "HeaderDeadlineProtocol",
        (_HeaderDeadlineProtocol,),
        {"header_timeout": header_timeout, "idle_timeout": idle_timeout, "min_body_rate": min_body_rate},
    )
