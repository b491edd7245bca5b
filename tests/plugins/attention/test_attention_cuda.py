"""Attention conformance numerics on CUDA: flash-attn, xformers and torch SDPA.

Every test skips with the backend's (or the device's) unavailable reason
on a machine without CUDA or without the optional packages
(``pip install 'patchbay[gpu]'``).
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from patchbay.testing import AttentionBackendSuite

pytestmark = pytest.mark.gpu


class CudaAttentionSuite(AttentionBackendSuite):
    device: ClassVar[str] = "cuda"
    dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")


class TestFlashAttnCuda(CudaAttentionSuite):
    plugin_name = "flash_attn"
    # 16: keys gathered into a ragged sequence; 256: flash-attn reads the paged cache through block_table.
    block_sizes: ClassVar[tuple[int, ...]] = (16, 256)


class TestXFormersCuda(CudaAttentionSuite):
    plugin_name = "xformers"


class TestTorchSDPACuda(CudaAttentionSuite):
    plugin_name = "torch_sdpa"
