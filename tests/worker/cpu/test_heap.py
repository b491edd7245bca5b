"""The engine's glibc allocator settings (patchbay.worker.cpu.heap)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from patchbay.worker.cpu import heap


def _glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"


def test_an_operators_environment_or_preloaded_allocator_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert "MALLOC_TRIM_THRESHOLD_" in heap.keep_freed_memory.__wrapped__()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4")
    assert "libtcmalloc" in heap.keep_freed_memory.__wrapped__()


FIRST_REUSE = """
import ctypes, sys
from patchbay.worker.cpu import heap
if sys.argv[1] == "kept":
    print(heap.keep_freed_memory(), file=sys.stderr)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
first = libc.malloc(12 << 20)  # a 64-request step's float32 logits
libc.free(first)
second = libc.malloc(12 << 20)
print(first == second)
"""


@pytest.mark.skipif(not _glibc(), reason="glibc's thresholds only")
@pytest.mark.parametrize("mode, reused", [("kept", True), ("defaults", False)])
def test_glibc_keeps_a_freed_step_sized_block_for_the_next_step(mode, reused):
    """In a fresh process glibc maps a first 12 MB block apart and unmaps it when freed, so the next one lands
    elsewhere (and faults its pages in again); with the engine's thresholds it comes back from the heap."""
    env = {key: value for key, value in os.environ.items() if key not in (*heap.OPERATOR_SETTINGS, "LD_PRELOAD")}
    result = subprocess.run(
        [sys.executable, "-c", FIRST_REUSE, mode], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == str(reused), result.stderr
