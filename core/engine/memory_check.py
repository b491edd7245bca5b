"""Memory a run's settings ask for, checked against what the machine has free before anything is allocated.

Without the check, ``cache.memory: 1PB`` or ``scheduler.max_num_seqs: 10**9``
allocate until the process dies of MemoryError (or the machine swaps to a
halt); with it, the error names the key and gives both figures.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from patchbay.contract.settings import ConfigError, ConfigProblem


def format_bytes(count: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(count) < 1024 or unit == "PiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError("unreachable")


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2) may still use, if it has a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        return None


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``; ``None`` when it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None and hasattr(os, "sysconf"):
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            available = None
    room = _cgroup_room()
    if room is not None:
        available = room if available is None else min(available, room)
    return available


def check_fits(requests: list[tuple[str, str, int]], device: torch.device) -> None:
    """Raise :class:`ConfigError` if the allocations ``(setting key, what, bytes)`` exceed the free memory.

    Each allocation is named with its key and size; the total is compared with what ``device`` has free.
    """
    available = available_memory(device)
    if available is None:
        return
    total = sum(size for _, _, size in requests)
    if total <= available:
        return
    problems = [
        ConfigProblem(
            "<run>",
            key,
            f"{what} needs {format_bytes(size)}; {device.type} memory available: "
            f"{format_bytes(available)} (for everything this run allocates: "
            f"{format_bytes(total)})",
        )
        for key, what, size in sorted(requests, key=lambda r: -r[2])
        if size > available / 4
    ]
    raise ConfigError(
        problems
        or [
            ConfigProblem(
                "<run>",
                requests[0][0],
                f"the run needs {format_bytes(total)}; {device.type} memory available: {format_bytes(available)}",
            )
        ]
    )
