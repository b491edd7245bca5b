"""Instruments for one engine step that a busy machine does not spoil (standard library; torch where it runs).

Shared by ``profile_step.py`` (patchbay) and ``profile_step_vllm.py`` (vLLM-CPU, in its own interpreter, where
patchbay is not installed): each hands a ``step()`` callable that runs one decode step of its engine.

- :func:`counts`: Python function calls and C functions called from Python per step (``cProfile``), and torch
  operators per step (``torch.profiler``): the same on a quiet or a busy machine;
- :func:`cpu_split`: the main thread's CPU time per step (``time.thread_time``, which leaves out the time the
  thread waited for a core), by the part of the step each function belongs to, and the heaviest functions;
- :func:`torch_op_times`: torch operators by their own CPU time;
- :func:`wall`: wall and main-thread CPU milliseconds per step, for reference.

Nothing here asserts a time.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

Step = Callable[[], object]
Function = tuple[str, int, str]
"""A ``cProfile`` entry's key: file, line, name (``~`` and 0 for a C function)."""


def _profiled(step: Step, steps: int, profile: cProfile.Profile) -> dict[Function, tuple[Any, ...]]:
    profile.enable()
    try:
        for _ in range(steps):
            step()
    finally:
        profile.disable()
    return pstats.Stats(profile).stats  # type: ignore[attr-defined,no-any-return]


def counts(step: Step, steps: int, top: int = 15) -> dict[str, Any]:
    """Calls per step: Python functions, C functions called from Python (the ``top`` most called), torch ops."""
    stats = _profiled(step, steps, cProfile.Profile())
    python = sum(entry[1] for (filename, _, _), entry in stats.items() if filename != "~")
    c_calls = Counter({name: entry[1] for (filename, _, name), entry in stats.items() if filename == "~"})
    figures: dict[str, Any] = {
        "python_calls_per_step": python / steps,
        "c_calls_per_step": sum(c_calls.values()) / steps,
        "top_c_calls_per_step": {name: calls / steps for name, calls in c_calls.most_common(top)},
    }
    try:
        import torch
    except ImportError:
        return figures
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            step()
    ops = Counter({event.key: event.count for event in profiler.key_averages()})
    figures["torch_ops_per_step"] = sum(ops.values()) / steps
    figures["top_torch_ops_per_step"] = {name: calls / steps for name, calls in ops.most_common(top)}
    return figures


def cpu_split(step: Step, steps: int, category: Callable[[Function], str], top: int = 20) -> dict[str, Any]:
    """The main thread's CPU milliseconds per step, its share by ``category`` of each function's own time, and
    the ``top`` heaviest functions (``cProfile`` on ``time.thread_time_ns``)."""
    stats = _profiled(step, steps, cProfile.Profile(time.thread_time_ns, 1e-9))  # type: ignore[call-arg]
    parts: Counter[str] = Counter()
    heaviest: Counter[str] = Counter()
    for function, entry in stats.items():
        own_seconds = entry[2]
        parts[category(function)] += own_seconds
        heaviest[f"{Path(function[0]).name}:{function[2]}"] += own_seconds
    total = sum(parts.values()) or 1.0
    return {
        "cpu_ms_per_step": 1e3 * total / steps,
        "cpu_share": {part: seconds / total for part, seconds in parts.most_common()},
        "heaviest_cpu_ms_per_step": {name: 1e3 * seconds / steps for name, seconds in heaviest.most_common(top)},
    }


def torch_op_times(step: Step, steps: int, top: int = 20) -> dict[str, Any]:
    """torch operators by their own CPU milliseconds per step (the ``top`` heaviest); empty without torch."""
    try:
        import torch
    except ImportError:
        return {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            step()
    events = sorted(profiler.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    return {"torch_op_self_cpu_ms_per_step": {e.key: e.self_cpu_time_total / 1e3 / steps for e in events[:top]}}


def wall(step: Step, steps: int) -> dict[str, float]:
    """Median and fastest wall milliseconds per step, and the main thread's median CPU milliseconds."""
    walls, cpus = [], []
    for _ in range(steps):
        started, started_cpu = time.perf_counter(), time.thread_time()
        step()
        walls.append(time.perf_counter() - started)
        cpus.append(time.thread_time() - started_cpu)
    return {
        "wall_ms_per_step": 1e3 * statistics.median(walls),
        "fastest_wall_ms_per_step": 1e3 * min(walls),
        "main_thread_cpu_ms_per_step": 1e3 * statistics.median(cpus),
    }


def by_name(categories: tuple[tuple[str, tuple[str, ...]], ...]) -> Callable[[Function], str]:
    """A ``category`` for :func:`cpu_split`: a C function by the first of ``categories`` one of whose needles its
    name holds, else "other C calls"; a Python function's own time is "Python"."""

    def category(function: Function) -> str:
        filename, _, name = function
        if filename != "~":
            return "Python"
        for label, needles in categories:
            if any(needle in name for needle in needles):
                return label
        return "other C calls (torch ops, tensor methods)"

    return category
