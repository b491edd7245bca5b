"""``patchbay serve CONFIG``: load the engine, serve it over HTTP until SIGTERM or Ctrl-C, shut down gracefully.

On SIGTERM uvicorn stops accepting connections and waits up to
``server.shutdown_grace_period`` seconds for responses in flight; then the
engine aborts what is left (clients see an ``abort`` finish, see
:mod:`patchbay.entrypoints.serve.shutdown`), lets a KV connector finish its
transfers, and the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import TextIO

from patchbay.contract.settings import Settings
from patchbay.engine import AsyncLLM

logger = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port); errors name the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"server: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(llm: AsyncLLM, settings: Settings):  # noqa: ANN201 - uvicorn.Server
    """The uvicorn server of ``build_app(llm, settings)``; the engine shuts down with it."""
    import uvicorn

    from patchbay.entrypoints.serve.app import build_app
    from patchbay.entrypoints.serve.connections import protocol_with_header_deadline
    from patchbay.entrypoints.serve.limits import with_limits
    from patchbay.entrypoints.serve.shutdown import FORCE_AFTER, GracefulServer

    app = build_app(llm, settings)
    grace = settings.server.shutdown_grace_period

    @contextlib.asynccontextmanager
    async def lifespan(_app) -> AsyncIterator[None]:  # noqa: ANN001
        yield
        app.state.patchbay.accepting = False
        await llm.shutdown(grace_period=0.0)  # uvicorn already waited the grace period for responses in flight

    app.router.lifespan_context = lifespan
    server = settings.server
    limited = with_limits(app, server.host, server.max_body_bytes, server.allowed_hosts)
    config = uvicorn.Config(
        limited,
        log_level="info" if settings.server.log_requests else "warning",
        access_log=settings.server.log_requests,
        # uvicorn annotates ints but hands both to asyncio timers, which take float seconds.  Its deadline
        # cancels the handlers; ours (the grace period) aborts the requests first, so theirs is a backstop.
        timeout_graceful_shutdown=grace + FORCE_AFTER,  # type: ignore[arg-type]
        timeout_keep_alive=server.idle_timeout,  # type: ignore[arg-type]
        lifespan="on",
        http=protocol_with_header_deadline(server.header_timeout, server.idle_timeout),
    )
    return GracefulServer(config, llm=llm, state=app.state.patchbay, grace_period=grace)


async def _serve_until_signal(server, sock: socket.socket) -> None:  # noqa: ANN001 - uvicorn.Server
    """Serve; SIGTERM or SIGINT starts the graceful shutdown (a second one ends the grace period at once, a
    third forces the exit), and the exit is clean.

    uvicorn's own handlers re-raise the signal once it has shut down, which
    would kill the process before the engine and the KV connector are released.
    """
    server.capture_signals = contextlib.nullcontext
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.handle_exit, signum, None)
    await server.serve(sockets=[sock])


def serve_from_settings(settings: Settings, *, stream: TextIO = sys.stdout) -> int:
    """Run the server ``settings`` describe until SIGTERM/SIGINT; the exit status of ``patchbay serve``."""
    sock = bind(settings.server.host, settings.server.port)
    llm = AsyncLLM(settings)
    server = make_server(llm, settings)
    host, port = sock.getsockname()[:2]
    from patchbay.entrypoints.serve.app import model_name_of

    print(
        f"patchbay serve: {model_name_of(settings)} on http://{host}:{port}/v1 (metrics at /metrics)",
        file=stream,
        flush=True,
    )
    try:
        asyncio.run(_serve_until_signal(server, sock))
    finally:
        sock.close()
        if llm.alive:  # a start-up failure before the lifespan ran
            asyncio.run(llm.shutdown())
    print("patchbay serve: stopped", file=stream, flush=True)
    return 0
