"""How loaded the machine was while the CPU tuning measured, and whether its choice can be kept.

A busy neighbour slows some products far more than others (a product whose threads wait for each other loses a
whole core's turn), so a tuning measured beside one can choose paths that are slow on the quiet machine, and a
cached choice would stay wrong for good.  Three instruments, none of which a neighbour can fake into "quiet":

- **a reference kernel** (:data:`REFERENCE_SHAPE`, a float32 product on every thread) timed beside every case
  the tuning measures, in the same loop: on a quiet machine its time stays put; its spread over the run
  (:data:`REFERENCE_SPREAD`) says the load changed while the cases were timed, and its fastest time against the
  fastest this machine ever measured (:data:`REFERENCE_SLOWDOWN`) says the whole run was slow;
- **the time the process's threads waited for a core** while the reference kernel ran (Linux's per-thread
  ``schedstat``; :data:`MAX_CPU_WAIT`): a neighbour that keeps the cores busy shows here on the very first run,
  before any quiet record exists;
- **the spread across repeats**: the rounds the tuning repeats must agree (:data:`ROUNDS_AGREE`).

A tuning with any of them over its limit is *provisional*: the run uses it, nothing caches it, the next start
measures again.  A cached tuning is rechecked at each start by a few runs of the reference kernel: where the
machine is now clearly faster than when the tuning measured (:data:`REFERENCE_SLOWDOWN`), it was measured under
load the checks missed, and is measured again.

The clock is an interface (:class:`Clock`), so tests drive the tuning with a faked, noisy one.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

REFERENCE_SHAPE = (32, 1024, 2048)
"""Rows, input and output features of the reference kernel: a float32 product on every thread, ~1 ms."""
REFERENCE_SPREAD = 1.25
"""The reference kernel's 90th-percentile time over its fastest, in one tuning run, above which the load changed
while the cases were timed."""
REFERENCE_SLOWDOWN = 1.25
"""The reference kernel's fastest time in a run over the fastest this machine ever measured (or, at a start with a
cached tuning, the tuning's own over now's), above which the run was slowed throughout."""
MAX_CPU_WAIT = 0.10
"""Share of its threads' time the reference kernel spent waiting for a core, above which the machine was busy."""
ROUNDS_AGREE = 1.15
"""Two rounds of the tuning agree where their times differ by at most this factor (geometric mean over every path
and bucket)."""
RECHECK_SAMPLES = 5
"""Runs of the reference kernel when a cached tuning is rechecked at a start; the fastest counts."""


class Clock(Protocol):
    """What the tuning times its cases with; the real one is :class:`WallClock`, tests fake it."""

    def time(self, case: str, run: Callable[[], object], budget: float) -> float:
        """Seconds one ``run()`` takes (the median of as many as ``budget`` seconds allow, at least three);
        ``case`` names what runs (``tiled_bfloat16/8``)."""
        ...

    def reference(self) -> float:
        """Seconds of the reference kernel now, run beside a case: kept with the others for the noise check."""
        ...

    def fastest_reference(self, samples: int) -> float:
        """The fastest of ``samples`` runs of the reference kernel now (a recheck; not kept)."""
        ...

    def reference_times(self) -> list[float]:
        """Every time :meth:`reference` measured so far, in order."""
        ...

    def cpu_wait(self) -> float | None:
        """Share of its threads' time the reference kernel waited for a core so far; ``None``: unknown here."""
        ...


@dataclass
class NoiseCheck:
    """What the instruments said about one tuning run, and why it is provisional (``reasons``; none: quiet)."""

    rounds: int = 0
    rounds_spread: float = 1.0
    """How far the last two rounds' times are apart (geometric mean of the larger over the smaller)."""
    reference_seconds: float | None = None
    """The reference kernel's fastest time in the run (``None``: not measured)."""
    reference_spread: float | None = None
    """Its 90th-percentile time over its fastest."""
    reference_slowdown: float | None = None
    """Its fastest over the fastest this machine measured before (``None``: no earlier record)."""
    cpu_wait: float | None = None
    """Share of its threads' time it waited for a core (``None``: unknown on this system)."""
    reasons: list[str] = field(default_factory=list)

    @property
    def provisional(self) -> bool:
        """Measured under noise: use it for this run only, cache nothing."""
        return bool(self.reasons)

    @classmethod
    def from_dict(cls, fields: dict[str, Any] | None) -> NoiseCheck | None:
        """From its JSON form (a cached tuning's ``noise``); ``None`` stays ``None``."""
        return cls(**fields) if fields is not None else None


def assess(
    rounds: int, rounds_spread: float, references: list[float], cpu_wait: float | None, record: float | None
) -> NoiseCheck:
    """The noise check of one tuning run: ``rounds`` measured, the last two ``rounds_spread`` apart; the reference
    kernel's ``references`` times and ``cpu_wait``; ``record``, the fastest reference time this machine measured
    before (``None``: none yet)."""
    check = NoiseCheck(rounds=rounds, rounds_spread=rounds_spread, cpu_wait=cpu_wait)
    if rounds_spread > ROUNDS_AGREE:
        check.reasons.append(f"its last two rounds differ by {rounds_spread:.2f}x")
    if references:
        fastest = min(references)
        check.reference_seconds = fastest
        check.reference_spread = _percentile(references, 0.9) / fastest
        if check.reference_spread > REFERENCE_SPREAD:
            check.reasons.append(f"the reference kernel's time varied {check.reference_spread:.2f}x while it measured")
        if record is not None:
            check.reference_slowdown = fastest / record
            if check.reference_slowdown > REFERENCE_SLOWDOWN:
                check.reasons.append(
                    f"the reference kernel ran {check.reference_slowdown:.2f}x slower than this machine's fastest"
                )
    if cpu_wait is not None and cpu_wait > MAX_CPU_WAIT:
        check.reasons.append(f"its threads waited for a core {100 * cpu_wait:.0f}% of the time")
    return check


def measured_under_load(reference_then: float | None, reference_now: float) -> bool:
    """Whether a cached tuning whose reference kernel took ``reference_then`` was measured on a machine clearly
    slower than now (``reference_now``): then it is measured again."""
    return reference_then is not None and reference_then > REFERENCE_SLOWDOWN * reference_now


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


class ThreadWaits:
    """Nanoseconds this process's threads spent runnable but waiting for a core (Linux ``schedstat``'s second
    field, per thread); unavailable elsewhere."""

    TASKS = Path("/proc/self/task")

    def snapshot(self) -> dict[str, int] | None:
        """Per thread id, its waiting so far; ``None`` where the system does not say."""
        waits = {}
        try:
            entries = list(self.TASKS.iterdir())
        except OSError:
            return None
        for entry in entries:
            try:
                waits[entry.name] = int((entry / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that ended between the listing and the read
        return waits or None

    @staticmethod
    def waited(before: dict[str, int], after: dict[str, int]) -> float:
        """Seconds of waiting between two snapshots, over the threads in both."""
        return sum(after[tid] - before[tid] for tid in before.keys() & after.keys()) / 1e9


class WallClock:
    """The real clock: ``time.perf_counter`` around each run, the reference kernel on ``threads`` threads, and
    the threads' waits read around each reference run."""

    def __init__(self, threads: int, waits: ThreadWaits | None = None) -> None:
        self.threads = max(1, threads)
        self.waits = waits or ThreadWaits()
        self._references: list[float] = []
        self._waited = 0.0
        self._waited_over = 0.0
        self._waits_known = True
        self._operands: tuple[torch.Tensor, torch.Tensor] | None = None

    def time(self, case: str, run: Callable[[], object], budget: float) -> float:
        """The median of at least three timed runs after a warm-up (first-call allocations and packing), as
        many as ``budget`` seconds allow up to 50."""
        with torch.inference_mode():
            run()
            samples: list[float] = []
            deadline = time.perf_counter() + budget
            while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 50):
                started = time.perf_counter()
                run()
                samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    def reference(self) -> float:
        """The faster of two reference runs, with the threads' waits around them."""
        before = self.waits.snapshot()
        started = time.perf_counter()
        seconds = min(self._reference_once() for _ in range(2))
        elapsed = time.perf_counter() - started
        after = self.waits.snapshot()
        if before is None or after is None:
            self._waits_known = False
        else:
            self._waited += ThreadWaits.waited(before, after)
            self._waited_over += elapsed * self.threads
        self._references.append(seconds)
        return seconds

    def fastest_reference(self, samples: int) -> float:
        """The fastest of ``samples`` reference runs (after a warm-up run)."""
        self._reference_once()
        return min(self._reference_once() for _ in range(samples))

    def reference_times(self) -> list[float]:
        """Every time :meth:`reference` measured so far."""
        return list(self._references)

    def cpu_wait(self) -> float | None:
        """Waiting over the reference runs' thread time (``None`` without ``schedstat`` or reference runs)."""
        if not self._waits_known or self._waited_over == 0:
            return None
        return self._waited / self._waited_over

    def _reference_once(self) -> float:
        if self._operands is None:
            rows, inputs, outputs = REFERENCE_SHAPE
            generator = torch.Generator().manual_seed(0)
            self._operands = (
                torch.randn(rows, inputs, generator=generator),
                torch.randn(outputs, inputs, generator=generator),
            )
            F.linear(*self._operands)  # first-call allocations
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                started = time.perf_counter()
                F.linear(*self._operands)
                return time.perf_counter() - started
        finally:
            torch.set_num_threads(previous)


def record_path(folder: Path, key: str) -> Path:
    """Where the fastest reference time for the machine ``key`` is kept (beside the tunings)."""
    return folder / f"reference-{key}.json"


def cpu_count_note() -> str:
    """The cores this process may use, for messages."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores"
