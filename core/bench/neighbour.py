"""A synthetic neighbour for the bench: one busy process at the lowest priority, spinning on one core.

Shared machines are rarely quiet; an engine whose threads spin while they wait
loses most of its speed to a neighbour that only takes idle time.  The bench
runs a workload once quietly and once beside :class:`BusyNeighbour`, which it
starts and always stops (the context manager ends it on every way out,
an error included).
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import TracebackType

SPIN = """
import os, sys
os.nice(19)
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {int(sys.argv[1])})
while True:
    pass
"""
"""The neighbour's program: lowest priority, pinned to the core given, a busy loop."""
STOP_TIMEOUT_S = 10.0


class BusyNeighbour:
    """``with BusyNeighbour(): ...`` runs the block beside a process spinning at ``nice 19`` on ``core``
    (default: the last core this process may use)."""

    def __init__(self, core: int | None = None) -> None:
        if core is None:
            allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
            core = allowed[-1]
        self.core = core
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError("the bench's neighbour is already running")
        self.process = subprocess.Popen(
            [sys.executable, "-c", SPIN, str(self.core)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )

    def stop(self) -> None:
        """End the neighbour (terminate, then kill after :data:`STOP_TIMEOUT_S`) and reap it; safe to repeat."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> BusyNeighbour:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
