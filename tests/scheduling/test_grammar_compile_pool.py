"""Grammar compiles as a pool (issue 57, item 10): a short constraint never waits behind slow schemas, the queue
is bounded, each constraint's deadline runs from its submission, and large compiles past their deadline keep
their worker, so no more than ``max_workers`` of them ever hold memory at once."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import pytest

from patchbay.interfaces import GrammarMatcher, StructuredOutputBackend, StructuredOutputParams
from patchbay.scheduling.structured_output import GrammarCompilations, GrammarCompileTimeout

try:
    from patchbay.scheduling.structured_output import GrammarCompileBusy
except ImportError:  # before issue 57 there was no such refusal: the checks below fail on their own terms
    GrammarCompileBusy = RuntimeError  # type: ignore[assignment,misc]


class SlowBackend(StructuredOutputBackend):
    """Compiles a ``slow...`` regex only once the test releases it; anything else at once.  Each test gets a
    subclass of its own (the ``slow`` fixture), so compiles a finished test left running count nowhere else."""

    release: ClassVar[threading.Event]
    running: ClassVar[list[str]]
    most_running: ClassVar[int]
    lock: ClassVar[threading.Lock]

    def compile(self, params: StructuredOutputParams) -> Any:
        cls = type(self)
        with cls.lock:
            cls.running.append(params.spec)
            cls.most_running = max(cls.most_running, sum(spec.startswith("slow") for spec in cls.running))
        try:
            if params.spec.startswith("slow"):
                cls.release.wait(timeout=30)
            return params.spec
        finally:
            with cls.lock:
                cls.running.remove(params.spec)

    def grammar_size_bytes(self, grammar: Any, params: StructuredOutputParams) -> int:
        return len(params.spec)

    def matcher(self, grammar: Any) -> GrammarMatcher:
        raise NotImplementedError


@pytest.fixture
def slow():
    backend = type(
        "SlowBackend",
        (SlowBackend,),
        {"release": threading.Event(), "running": [], "most_running": 0, "lock": threading.Lock()},
    )
    yield backend
    backend.release.set()


def _pool(backend: type[SlowBackend], **kwargs: Any) -> GrammarCompilations:
    return GrammarCompilations(lambda: backend(tokenizer=None, vocab_size=32, stop_token_ids=[0]), "slow", **kwargs)


LARGE_CHARS = 64 << 10
"""Past the pool's bound for small constraints (``SMALL_CONSTRAINT_CHARS``)."""


def _large(index: int) -> StructuredOutputParams:
    return StructuredOutputParams(regex=f"slow-{index}-" + "x" * LARGE_CHARS)


def test_a_short_choice_does_not_wait_behind_eight_slow_schemas(slow):
    grammars = _pool(slow, compile_timeout=30.0)
    waiting = [grammars.submit(_large(index)) for index in range(8)]
    started = time.monotonic()
    assert grammars.submit(StructuredOutputParams(choice=["yes", "no"])).result(timeout=10) is not None
    assert time.monotonic() - started < 5.0
    assert not any(future.done() for future in waiting)


def test_large_compiles_past_their_deadline_keep_their_worker(slow):
    """Three huge schemas that each time out: at most ``max_workers`` of them ever compile at once."""
    grammars = _pool(slow, compile_timeout=0.3, max_workers=2, max_runaway=2)
    futures = [grammars.submit(_large(index)) for index in range(3)]
    for future in futures:
        with pytest.raises((GrammarCompileTimeout, GrammarCompileBusy)):
            future.result(timeout=10)
    time.sleep(0.5)
    assert slow.most_running <= 2, f"{slow.most_running} large compiles held memory at once"


def test_the_queue_is_bounded_and_a_queued_constraint_s_deadline_runs_from_its_submission(slow):
    grammars = _pool(slow, compile_timeout=0.5, max_workers=1, max_queued=2)
    first = grammars.submit(_large(0))  # takes the one worker for large constraints
    queued = [grammars.submit(_large(index)) for index in (1, 2)]
    refused = grammars.submit(_large(3))
    assert refused.done() and isinstance(refused.exception(), GrammarCompileBusy)
    assert "structured_output.max_queued_compiles" in str(refused.exception())
    started = time.monotonic()
    for future in queued:
        with pytest.raises(GrammarCompileBusy, match="waited longer than structured_output.compile_timeout"):
            future.result(timeout=10)
    assert time.monotonic() - started < 3.0
    with pytest.raises(GrammarCompileTimeout):
        first.result(timeout=10)
