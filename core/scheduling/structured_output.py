"""Grammar compilation for structured output: asynchronous, cached by constraint, off the step's path.

The scheduler submits a constrained request's constraint when the request
arrives; a worker thread compiles it through the run's grammar backend while
steps go on, and the request waits (``WAITING_FOR_GRAMMAR``, vLLM's
``WAITING_FOR_FSM``) until its grammar is ready.  Requests with the same
constraint share one compilation.  The backend itself is built on first use,
so runs without constrained requests never pay for its tokenizer tables.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from patchbay.interfaces import StructuredOutputBackend, StructuredOutputParams
from patchbay.interfaces.structured_output import CONSTRAINT_KINDS

GrammarKey = tuple[str, str]


@dataclass
class CompileStats:
    """Grammar compilations of a run: how many, how long (seconds, on the worker thread), cache hits."""

    num_compiled: int = 0
    num_failed: int = 0
    num_cache_hits: int = 0
    compile_seconds: list[float] = field(default_factory=list)
    backend_init_seconds: float = 0.0


class GrammarCompilations:
    """Compiles constraints on a worker thread and keeps the latest ``cache_size`` results by key."""

    def __init__(
        self,
        backend_factory: Callable[[], StructuredOutputBackend],
        backend_name: str,
        *,
        constraint_kinds: tuple[str, ...] = CONSTRAINT_KINDS,
        cache_size: int = 256,
        max_workers: int = 1,
    ) -> None:
        self.backend_name = backend_name
        self.constraint_kinds = constraint_kinds
        """What the backend declares it compiles (its capabilities' ``constraint_kinds``)."""
        self._backend_factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._cache_size = cache_size
        self._futures: OrderedDict[GrammarKey, concurrent.futures.Future[Any]] = OrderedDict()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="patchbay-grammar")
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
        """Start compiling ``params`` (or reuse the compilation of the same constraint)."""
        key = params.key
        future = self._futures.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._futures.move_to_end(key)
            self.stats.num_cache_hits += 1
            return future
        future = self._executor.submit(self._compile, params)
        self._futures[key] = future
        while len(self._futures) > self._cache_size:
            oldest_key, oldest = next(iter(self._futures.items()))
            if not oldest.done():
                break  # still wanted by a waiting request; the cache shrinks once it is done
            del self._futures[oldest_key]
        return future

    def _compile(self, params: StructuredOutputParams) -> Any:
        backend = self.backend
        started = time.perf_counter()
        try:
            grammar = backend.compile(params)
        except Exception:
            self.stats.num_failed += 1
            raise
        self.stats.compile_seconds.append(time.perf_counter() - started)
        self.stats.num_compiled += 1
        return grammar

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
        """Stop the worker thread (pending compilations are cancelled)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
