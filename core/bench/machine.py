"""What this machine can do, measured on the spot: memory bandwidth (read, STREAM copy, triad), float32 GEMM rate."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MachineLimits:
    description: str
    threads: int
    read_bandwidth_gb_s: float
    """Best of several full reads (a sum) of a buffer far larger than the caches, all threads."""
    gemm_gflop_s: float
    """Best float32 rate of a large matrix product shaped like a prefill chunk of a small model."""
    copy_bandwidth_gb_s: float = 0.0
    """STREAM's copy, ``a = b``: bytes read and written per second, best of five (0: not measured)."""
    triad_bandwidth_gb_s: float = 0.0
    """STREAM's triad, ``a = b + s * c``: bytes read and written per second, best of five (0: not measured)."""

    @property
    def stream_bandwidth_gb_s(self) -> float:
        """The bandwidth a batch-1 decode is held to: the triad's where measured, else the plain read's."""
        return self.triad_bandwidth_gb_s or self.read_bandwidth_gb_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def best_seconds(action: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of ``repeats`` timed calls (after one untimed call): the least disturbed by neighbours."""
    action()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_read_bandwidth(megabytes: int = 1024) -> float:
    """GB/s of reading a ``megabytes`` float32 buffer once (``sum``), best of five."""
    buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    seconds = best_seconds(lambda: buffer.sum())
    return buffer.numel() * 4 / seconds / 1e9


def measure_stream(megabytes: int = 256) -> tuple[float, float]:
    """GB/s of STREAM's copy (``a = b``, two arrays' bytes moved) and triad (``a = b + 3 * c``, three arrays'
    bytes) on float32 arrays of ``megabytes`` each, best of five, as STREAM counts them (writes counted once)."""
    count = megabytes * (1 << 20) // 4
    a, b, c = torch.empty(count), torch.ones(count), torch.ones(count)
    copy_seconds = best_seconds(lambda: a.copy_(b))
    triad_seconds = best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a))
    return 2 * count * 4 / copy_seconds / 1e9, 3 * count * 4 / triad_seconds / 1e9


def measure_gemm_rate(rows: int = 2048, inner: int = 1024, cols: int = 2048) -> float:
    """GFLOP/s of a float32 ``[rows, inner] @ [inner, cols]`` product, best of five."""
    left = torch.randn(rows, inner)
    right = torch.randn(inner, cols)
    seconds = best_seconds(lambda: left @ right)
    return 2 * rows * inner * cols / seconds / 1e9


def describe_machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    if torch.backends.cpu.get_cpu_capability():
        flags = f", torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    return f"{cpu}, {os.cpu_count()} logical cores{flags}, torch {torch.__version__}"


def measure_machine() -> MachineLimits:
    """Measure the limits with torch's current thread count."""
    copy, triad = measure_stream()
    return MachineLimits(
        describe_machine(), torch.get_num_threads(), measure_read_bandwidth(), measure_gemm_rate(), copy, triad
    )
