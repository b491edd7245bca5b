"""``patchbay serve CONFIG``: load the engine, serve it over HTTP until SIGTERM or Ctrl-C, shut down gracefully.

The port is bound first (a taken one fails before the model loads) but
listens only once the model is up, so until then a client's connection is
refused, never accepted and then reset; SIGTERM and SIGINT are handled from
that moment on, and one that arrives while the model loads stops the start
cleanly (exit status 0).

On SIGTERM uvicorn stops accepting connections and waits up to
``server.shutdown_grace_period`` seconds for responses in flight; then the
engine aborts what is left (clients see an ``abort`` finish, see
:mod:`patchbay.entrypoints.serve.shutdown`), lets a KV connector finish its
transfers, and the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator
from typing import TextIO

from patchbay.contract.settings import Settings
from patchbay.engine import AsyncLLM

logger = logging.getLogger(__name__)


def bind(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free port), listening unless ``listen`` is false (then
    connections are refused until :func:`start_listening`); errors name the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"server: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if listen:
        start_listening(sock)
    return sock


def start_listening(sock: socket.socket) -> None:
    """Accept connections on the bound ``sock`` from now on."""
    sock.listen(2048)
    sock.set_inheritable(True)


def make_server(llm: AsyncLLM, settings: Settings):  # noqa: ANN201 - uvicorn.Server
    """The uvicorn server of ``build_app(llm, settings)``; the engine shuts down with it."""
    import uvicorn

    from patchbay.entrypoints.serve.app import build_app
    from patchbay.entrypoints.serve.connections import protocol_with_header_deadline
    from patchbay.entrypoints.serve.limits import with_limits
    from patchbay.entrypoints.serve.shutdown import FORCE_AFTER, GracefulServer
    from patchbay.entrypoints.serve.stats_log import stats_logging

    app = build_app(llm, settings)
    grace = settings.server.shutdown_grace_period

    @contextlib.asynccontextmanager
    async def lifespan(_app) -> AsyncIterator[None]:  # noqa: ANN001
        async with stats_logging(llm, settings.server.stats_interval):
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
        http=protocol_with_header_deadline(server.header_timeout, server.idle_timeout, server.min_body_rate),
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


def log_like_uvicorn() -> None:
    """Send patchbay's own log lines (the stats line, the KV cache's size, warnings) to stderr in uvicorn's format
    (``INFO:     engine: ...``), next to its access log."""
    from uvicorn.logging import DefaultFormatter

    root = logging.getLogger("patchbay")
    if any(isinstance(handler.formatter, DefaultFormatter) for handler in root.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


class _StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT before the server took its first connection (a BaseException, as KeyboardInterrupt is,
    so no ``except Exception`` on the loading path turns it into a load failure)."""


def _stop_starting(signum: int, frame: object) -> None:
    raise _StoppedWhileStarting(signal.Signals(signum).name)


def serve_from_settings(settings: Settings, *, stream: TextIO = sys.stdout) -> int:
    """Run the server ``settings`` describe until SIGTERM/SIGINT; the exit status of ``patchbay serve``."""
    from patchbay.entrypoints.serve.state import model_name_of

    log_like_uvicorn()
    sock = bind(settings.server.host, settings.server.port, listen=False)
    host, port = sock.getsockname()[:2]
    handled = threading.current_thread() is threading.main_thread()
    if handled:  # until the event loop takes them over (_serve_until_signal)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _stop_starting)
    print(
        f"patchbay serve: loading {model_name_of(settings)} (port {port} listens once it is loaded)",
        file=sys.stderr,
        flush=True,
    )
    llm: AsyncLLM | None = None
    try:
        llm = AsyncLLM(settings)
        server = make_server(llm, settings)
        # The model, torch and the libraries are the heap from now on: left out of the collector's full passes,
        # which hold the GIL for as long as they walk it (a large request's passes stalled /health by a second).
        gc.freeze()
        start_listening(sock)
        print(
            f"patchbay serve: {model_name_of(settings)} on http://{host}:{port}/v1 (metrics at /metrics)",
            file=stream,
            flush=True,
        )
        asyncio.run(_serve_until_signal(server, sock))
    except _StoppedWhileStarting as stopped:
        if handled:  # a second signal while the engine is released ends the process at once
            _default_signal_handlers()
        print(f"patchbay serve: {stopped} while starting; stopped before serving", file=stream, flush=True)
        return 0
    finally:
        sock.close()
        if llm is not None and llm.alive:  # a start-up failure, or a signal, before the lifespan ran
            asyncio.run(llm.shutdown())
        if handled:
            _default_signal_handlers()
    print("patchbay serve: stopped", file=stream, flush=True)
    return 0


def _default_signal_handlers() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
