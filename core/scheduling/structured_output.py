"""Grammar compilation for structured output: asynchronous, cached by constraint, bounded in time and memory.

The scheduler submits a constrained request's constraint when the request
arrives; a compile thread compiles it through the run's grammar backend while
steps go on, and the request waits (``WAITING_FOR_GRAMMAR``, vLLM's
``WAITING_FOR_FSM``) until its grammar is ready.  Requests with the same
constraint share one compilation.  The backend itself is built on first use,
so runs without constrained requests never pay for its tokenizer tables.

A compile cannot be interrupted (backends compile in native code), so each
one runs on a thread of its own, at most ``max_workers`` at once plus one
kept for small constraints (:data:`SMALL_CONSTRAINT_CHARS`): a short
``choice`` never waits behind huge schemas.  Queued constraints start
smallest first; at most ``max_queued`` wait, one more fails at once with
:class:`GrammarCompileBusy`.  Each compile has a deadline from the moment
it is submitted, queueing included: past ``compile_timeout`` its requests
fail (:class:`GrammarCompileBusy` if it never started,
:class:`GrammarCompileTimeout` if it ran too long).  A compile that runs too
long finishes in the background and its result is dropped; a large one
keeps its worker until then, so at most ``max_workers`` large compiles ever
hold memory at once, and at most ``max_runaway`` small ones run past their
time.  A constraint that timed out is remembered and fails at once when it
comes back, without compiling again.

Compiled grammars are kept, least recently used first out, while their
estimated sizes (the backend's :meth:`~StructuredOutputBackend.grammar_size_bytes`)
add up to at most ``cache_bytes``.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from patchbay.interfaces import StructuredOutputBackend, StructuredOutputParams
from patchbay.interfaces.structured_output import CONSTRAINT_KINDS

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, ...]

SLOW_COMPILE_SECONDS = 1.0
"""A compile at least this long is logged as a warning and named in the run summary."""

TIMED_OUT_KEPT = 1024
"""Constraints remembered as timed out (their keys only), so they fail at once when sent again."""


SMALL_CONSTRAINT_CHARS = 16 << 10
"""A constraint whose text (its cache key) is at most this long is small: it may use the worker kept for small
ones, and it never holds a worker past its deadline."""


class GrammarCompileTimeout(TimeoutError):
    """A constraint whose compile ran past ``structured_output.compile_timeout``."""


class GrammarCompileBusy(RuntimeError):
    """A constraint not compiled because the compile workers are busy: too many queued, or its deadline passed
    while it waited (retrying later may succeed)."""


@dataclass
class CompileStats:
    """Grammar compilations of a run: how many, how long (seconds, on the compile threads), cache hits."""

    num_compiled: int = 0
    num_failed: int = 0
    num_timed_out: int = 0
    num_cache_hits: int = 0
    num_evicted: int = 0
    compile_seconds: list[float] = field(default_factory=list)
    backend_init_seconds: float = 0.0
    cached_bytes: int = 0
    """Estimated size of the compiled grammars the cache holds now."""
    slow_compile_seconds: float = field(default_factory=lambda: SLOW_COMPILE_SECONDS)
    """A compile at least this long is logged as a warning and counted in :attr:`slow_compiles`."""

    @property
    def slow_compiles(self) -> list[float]:
        """Compile times of at least :attr:`slow_compile_seconds`."""
        return [seconds for seconds in self.compile_seconds if seconds >= self.slow_compile_seconds]


@dataclass
class _Entry:
    """One constraint's compilation: its future, and the compiled grammar's estimated size once done."""

    future: concurrent.futures.Future[Any]
    size: int = 0


@dataclass(order=True)
class _Queued:
    """A constraint waiting for a worker, ordered smallest first (then first come)."""

    size: int
    order: int
    params: StructuredOutputParams = field(compare=False)
    future: concurrent.futures.Future[Any] = field(compare=False)
    timer: threading.Timer | None = field(compare=False, default=None)

    @property
    def small(self) -> bool:
        return self.size <= SMALL_CONSTRAINT_CHARS


def _reusable(future: concurrent.futures.Future[Any]) -> bool:
    """Whether a cached compilation serves a new request: still running, or done with a grammar."""
    if not future.done():
        return True
    return not future.cancelled() and future.exception() is None


class GrammarCompilations:
    """Compiles constraints on compile threads and keeps the results within ``cache_bytes`` (estimated)."""

    def __init__(
        self,
        backend_factory: Callable[[], StructuredOutputBackend],
        backend_name: str,
        *,
        constraint_kinds: tuple[str, ...] = CONSTRAINT_KINDS,
        cache_bytes: int = 1 << 30,
        compile_timeout: float | None = None,
        max_workers: int = 2,
        max_runaway: int = 2,
        max_queued: int = 64,
    ) -> None:
        self.backend_name = backend_name
        self.constraint_kinds = constraint_kinds
        """What the backend declares it compiles (its capabilities' ``constraint_kinds``)."""
        self.compile_timeout = compile_timeout
        """Seconds a compile may run before its requests fail (``None``: no limit)."""
        self._backend_factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._cache_bytes = cache_bytes
        self._max_workers = max_workers
        self._max_runaway = max_runaway
        self._max_queued = max_queued
        self._lock = threading.RLock()
        self._entries: OrderedDict[GrammarKey, _Entry] = OrderedDict()
        self._timed_out: OrderedDict[GrammarKey, str] = OrderedDict()
        self._queue: list[_Queued] = []
        """A heap: the smallest constraint first."""
        self._order = itertools.count()
        self._num_running = 0
        """Compiles running within their time (they hold a worker)."""
        self._num_large_threads = 0
        """Threads compiling a large constraint, within their time or past it (a large one keeps its worker)."""
        self._num_runaway = 0
        """Small compiles past their timeout whose threads still run (their results will be dropped)."""
        self._closed = False
        self.stats = CompileStats()

    @property
    def backend(self) -> StructuredOutputBackend:
        """The grammar backend, built on first use (thread-safe)."""
        with self._backend_lock:
            if self._backend is None:
                started = time.perf_counter()
                self._backend = self._backend_factory()
                self.stats.backend_init_seconds = time.perf_counter() - started
            return self._backend

    def submit(self, params: StructuredOutputParams) -> concurrent.futures.Future[Any]:
        """Start compiling ``params`` (or reuse the compilation of the same constraint); thread-safe."""
        key = params.key
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and _reusable(entry.future):
                self._entries.move_to_end(key)
                self.stats.num_cache_hits += 1
                return entry.future
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            timed_out = self._timed_out.get(key)
            if timed_out is not None:
                self._timed_out.move_to_end(key)
                future.set_exception(GrammarCompileTimeout(timed_out))
                return future
            if len(self._queue) >= self._max_queued:
                future.set_exception(
                    GrammarCompileBusy(
                        f"{len(self._queue)} constraints are waiting to compile "
                        "(structured_output.max_queued_compiles); retry later"
                    )
                )
                return future
            self._entries[key] = _Entry(future)
            queued = _Queued(len(key[1]), next(self._order), params, future)
            if self.compile_timeout is not None:  # the deadline runs from now: waiting in the queue counts
                queued.timer = threading.Timer(self.compile_timeout, self._expire, (queued,))
                queued.timer.daemon = True
                queued.timer.start()
            heapq.heappush(self._queue, queued)
            self._start_queued()
            return future

    def _can_start(self, small: bool) -> bool:
        """Whether a constraint may start now (lock held): a small one on any free worker, the one kept for small
        ones included; a large one on the ``max_workers`` others, counting large ones still running late."""
        if self._closed:
            return False
        if small:  # runaway threads bound every compile thread, the kept worker's too
            return (
                self._num_running < self._max_workers + 1
                and self._num_running + self._num_runaway < self._max_workers + self._max_runaway
            )
        return self._num_running < self._max_workers and self._num_large_threads < self._max_workers

    def _start_queued(self) -> None:
        """Start queued compiles, smallest first, while :meth:`_can_start` allows (lock held)."""
        while self._queue and self._can_start(self._queue[0].small):
            queued = heapq.heappop(self._queue)
            if not queued.future.set_running_or_notify_cancel():
                continue
            self._num_running += 1
            if not queued.small:
                self._num_large_threads += 1
            thread = threading.Thread(target=self._run, args=(queued,), name="patchbay-grammar", daemon=True)
            thread.start()

    def _run(self, queued: _Queued) -> None:
        params, future = queued.params, queued.future
        started = time.perf_counter()
        grammar: Any = None
        error: BaseException | None = None
        size = 0
        try:
            grammar = self.backend.compile(params)
            size = max(0, int(self.backend.grammar_size_bytes(grammar, params)))
        except Exception as exc:  # noqa: BLE001 - handed to the requests waiting on it
            error = exc
        seconds = time.perf_counter() - started
        if queued.timer is not None:
            queued.timer.cancel()
        if seconds >= self.stats.slow_compile_seconds:
            logger.warning(
                "structured_output backend %r took %.1f s to compile %s (steps with only constrained requests "
                "wait for it; structured_output.compile_timeout bounds it)",
                self.backend_name,
                seconds,
                params.field_path,
            )
        with self._lock:
            if not queued.small:
                self._num_large_threads -= 1
            if future.done():  # timed out: its requests failed already, the result is dropped
                if queued.small:
                    self._num_runaway -= 1
            else:
                self._num_running -= 1
                if error is not None:
                    self.stats.num_failed += 1
                    self._forget(params.key, future)  # not cached: distinct bad constraints must not pile up
                    future.set_exception(error)
                else:
                    self.stats.num_compiled += 1
                    self.stats.compile_seconds.append(seconds)
                    future.set_result(grammar)
                    self._store(params.key, future, size)
            self._start_queued()

    def _expire(self, queued: _Queued) -> None:
        """The deadline of a constraint ``compile_timeout`` seconds after it was submitted: fail its requests; a
        queued one leaves the queue, a running one frees its worker (a large one only when its thread ends)."""
        params, future = queued.params, queued.future
        with self._lock:
            if future.done():
                return
            key = params.key
            if queued in self._queue:
                self._queue.remove(queued)
                heapq.heapify(self._queue)
                message = (
                    f"waited longer than structured_output.compile_timeout={self.compile_timeout:g} s for a compile "
                    f"worker ({self._num_running} compiling, {len(self._queue)} waiting); retry later"
                )
                self._forget(key, future)
                future.set_exception(GrammarCompileBusy(message))
                return
            message = (
                f"compiling took longer than structured_output.compile_timeout={self.compile_timeout:g} s; "
                "simplify the constraint (fewer choices, a smaller schema)"
            )
            self._num_running -= 1
            if queued.small:
                self._num_runaway += 1
            self.stats.num_timed_out += 1
            self._timed_out[key] = message
            while len(self._timed_out) > TIMED_OUT_KEPT:
                self._timed_out.popitem(last=False)
            self._forget(key, future)
            future.set_exception(GrammarCompileTimeout(message))
            self._start_queued()
        logger.warning("structured_output backend %r: %s (%s)", self.backend_name, message, params.field_path)

    def _forget(self, key: GrammarKey, future: concurrent.futures.Future[Any]) -> None:
        """Drop the cache entry of ``key`` if it is still ``future``'s (lock held)."""
        entry = self._entries.get(key)
        if entry is not None and entry.future is future:
            del self._entries[key]

    def _store(self, key: GrammarKey, future: concurrent.futures.Future[Any], size: int) -> None:
        """Count a finished grammar in the cache, then evict the least recently used done ones past the bound."""
        entry = self._entries.get(key)
        if entry is None or entry.future is not future:
            return
        entry.size = size
        self.stats.cached_bytes += size
        for old_key in list(self._entries):
            if self.stats.cached_bytes <= self._cache_bytes:
                break
            old = self._entries[old_key]
            if not old.future.done():
                continue  # still compiling for waiting requests
            del self._entries[old_key]
            self.stats.cached_bytes -= old.size
            self.stats.num_evicted += 1

    def error_message(self, params: StructuredOutputParams, exc: BaseException) -> str:
        """What a request whose constraint failed reports: backend, field, and the backend's reason."""
        return f"structured_output backend {self.backend_name!r} cannot compile {params.field_path}: {exc}"

    @staticmethod
    def wait_any(futures: Iterable[concurrent.futures.Future[Any]], timeout: float) -> None:
        """Block until one of ``futures`` is done or ``timeout`` seconds pass (the scheduler has nothing else to do)."""
        pending = [future for future in futures if not future.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def shutdown(self) -> None:
        """Start no more compiles; queued ones are cancelled (running ones end on their daemon threads)."""
        with self._lock:
            self._closed = True
            while self._queue:
                queued = heapq.heappop(self._queue)
                if queued.timer is not None:
                    queued.timer.cancel()
                queued.future.cancel()
