"""ASGI middleware that keeps one client from starving the server or reaching it from a rebound web page.

:class:`BodyLimit` answers 413 to a body over ``server.max_body_bytes``
before it is read whole: at once when ``Content-Length`` says so, else as
soon as the chunks received pass the limit (the rest is never read).
:class:`HostCheck` answers 400 to a ``Host`` header that names another
server while patchbay listens on a loopback address: a web page whose
domain was rebound to 127.0.0.1 sends its own domain as the host, so it
cannot talk to a keyless local server (DNS rebinding).  Both answer in
OpenAI's ``{"error": ...}`` shape.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from patchbay.entrypoints.serve.protocol import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


async def _answer(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with a 413, reading no more of them than the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> APIError:
        return APIError(
            413, f"request body over server.max_body_bytes={self.max_bytes} bytes", code="request_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _answer(send, self._error())
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await _answer(send, self._error())


def is_loopback(host: str) -> bool:
    """Whether the listen address ``host`` is reachable from this machine only."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class HostCheck:
    """Refuse requests whose ``Host`` is not one of ``allowed`` (names, without port; ``*``: any)."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = {name.strip("[]").lower() for name in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            if _host_name(host) not in self.allowed:
                await _answer(
                    send,
                    APIError(
                        400,
                        f"Host {host!r} is not served here: the server listens on "
                        f"loopback and answers only {sorted(self.allowed)} (a DNS-rebound "
                        f"page sends its own name); add it to server.allowed_hosts",
                        code="host_not_allowed",
                    ),
                )
                return
        await self.app(scope, receive, send)


def with_limits(app: ASGIApp, host: str, max_body_bytes: int, allowed_hosts: Iterable[str]) -> ASGIApp:
    """``app`` behind the body limit and, when ``host`` is a loopback address, the Host check."""
    limited: ASGIApp = BodyLimit(app, max_body_bytes)
    if is_loopback(host):
        limited = HostCheck(limited, [*LOOPBACK_NAMES, *allowed_hosts])
    return limited
