"""The torch_sdpa backend's C++ decode kernel as the kernel tests load it: built for this CPU, or limited to AVX2."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from patchbay.plugins.attention import _cpu_kernel
from patchbay.worker.cpu.tuning import CpuInfo

needs_kernel = pytest.mark.skipif(
    _cpu_kernel.kernel_unavailable() is not None, reason=f"kernel cannot build here: {_cpu_kernel.kernel_unavailable()}"
)
"""Mark a test module whose tests all call the kernel."""


def kernel_variant(name: str) -> Any:
    """The kernel as built for this CPU (``native``), or limited to AVX2 (``avx2``: the SIMD path of CPUs without
    AVX-512, built here too where the CPU has both)."""
    if name == "native":
        return _cpu_kernel.load_kernel()
    if not {"avx2", "fma"} <= CpuInfo.read().flags:
        pytest.skip("this CPU has no AVX2 and FMA")
    return _avx2_kernel()


@functools.cache
def _avx2_kernel() -> Any:
    return _cpu_kernel.extension().without_avx512().load()
