"""The server's shutdown: a grace period for requests in flight, then an ``abort`` that every client sees.

On the first SIGTERM or SIGINT the server stops accepting connections and
new requests (503); requests in flight go on for up to
``server.shutdown_grace_period`` seconds.  When it is over, or at once on a
second signal, every request still in flight is aborted in the engine:
streams end with a last chunk whose ``finish_reason`` is ``abort`` and
``data: [DONE]``, non-streamed requests get a 503 in OpenAI's error shape.
uvicorn's own deadline, which would cancel the handlers (plain-text 500s and
``CancelledError`` tracebacks), is set :data:`FORCE_AFTER` seconds later, as
a backstop only; a third signal forces the exit at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

FORCE_AFTER = 5.0
"""Seconds aborted requests get to send their last chunk before the exit is forced."""


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose shutdown aborts the requests in flight once the grace period is over."""

    def __init__(self, config: uvicorn.Config, *, llm: Any, state: Any, grace_period: float) -> None:
        super().__init__(config)
        self.llm = llm
        self.state = state
        """The app's ``ServerState``: its ``accepting`` turns false at the first signal."""
        self.grace_period = grace_period
        self._num_signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grace_timer: asyncio.TimerHandle | None = None

    async def shutdown(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.state.accepting = False
        if not self.state.grace_over:
            self._grace_timer = self._loop.call_later(self.grace_period, self.end_grace_period, "is over")
        try:
            await super().shutdown(sockets)
        finally:
            if self._grace_timer is not None:
                self._grace_timer.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._num_signals += 1
        name = signal.Signals(sig).name
        if self._num_signals == 1:
            logger.warning(
                "%s: finishing the requests in flight for up to %g s (server.shutdown_grace_period); "
                "send it again to abort them now",
                name,
                self.grace_period,
            )
            self.state.accepting = False
            self.should_exit = True
        elif self._num_signals == 2:
            self.end_grace_period(f"was cut short by a second {name}")
        else:
            logger.warning("%s again: exiting without waiting for the aborted requests", name)
            self.force_exit = True

    def end_grace_period(self, why: str) -> None:
        """Abort every request in flight (their clients get an ``abort`` finish), then force the exit
        :data:`FORCE_AFTER` seconds later if some connection still has not closed."""
        if self.state.grace_over:
            return
        self.state.grace_over = True
        self.state.accepting = False
        self.should_exit = True
        logger.warning("the shutdown grace period %s: aborting the requests in flight", why)
        if self.llm.alive:
            self.llm.abort_all_soon()
        if self._loop is not None:
            self._loop.call_later(FORCE_AFTER, self._force)

    def _force(self) -> None:
        self.force_exit = True
