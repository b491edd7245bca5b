"""Connections that send nothing, or their headers a byte at a time, are closed after a deadline.

uvicorn times out a kept-alive connection only after a response, and any
byte received restarts that timer; a client that opens connections and
sends nothing (or trickles header bytes) holds them, and their descriptors,
forever.  :func:`protocol_with_header_deadline` gives uvicorn's h11 protocol
one more timer: each request's headers must be complete within
``server.header_timeout`` seconds of the connection opening or the previous
response ending (plus ``server.idle_timeout`` then), else the connection is
closed.  Bodies are not under it: a slow upload is bounded by
``server.max_body_bytes``.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderDeadlineProtocol(H11Protocol):
    header_timeout: float = 10.0
    idle_timeout: float = 5.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
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
        if self.conn.their_state is not h11.IDLE:  # this request's headers are complete
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline(self.idle_timeout + self.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol_with_header_deadline(header_timeout: float, idle_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class, closing connections whose headers are not complete within the deadline."""
    return type(
        "HeaderDeadlineProtocol",
        (_HeaderDeadlineProtocol,),
        {"header_timeout": header_timeout, "idle_timeout": idle_timeout},
    )
