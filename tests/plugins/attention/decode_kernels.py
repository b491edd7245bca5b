"""The torch_sdpa backend's C++ decode kernel as the kernel tests load it: built for this CPU, or limited to AVX2."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

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


def expected_attention(
    query: torch.Tensor,
    keys_by_block: torch.Tensor,
    values_by_block: torch.Tensor,
    blocks: torch.Tensor,
    length: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    """The float64 reference for one query token ``[heads, head_size]``: SDPA over the first ``length`` keys of
    its block-table row ``blocks`` (the last ``window`` of them when ``window`` is set), from float caches
    ``[blocks, block_size, kv_heads, head_size]``; returns ``[heads, head_size]``."""
    block_size, kv_heads, head_size = keys_by_block.shape[1:]
    used = blocks[: -(-length // block_size)].long()
    first = max(0, length - window) if window else 0
    keys = keys_by_block[used].reshape(-1, kv_heads, head_size)[first:length].double()
    values = values_by_block[used].reshape(-1, kv_heads, head_size)[first:length].double()
    attended = F.scaled_dot_product_attention(
        query.double()[:, None], keys.transpose(0, 1), values.transpose(0, 1), scale=scale, enable_gqa=True
    )
    return attended[:, 0]
