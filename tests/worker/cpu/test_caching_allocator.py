"""The engine's heap: glibc's thresholds and the block cache torch's CPU tensors come from."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading

import pytest
import torch

from patchbay.worker.cpu import caching_allocator as heap


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
from patchbay.worker.cpu import caching_allocator as heap
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


needs_the_block_cache = pytest.mark.skipif(
    heap.build_unavailable() is not None, reason=f"the block cache cannot be built here: {heap.build_unavailable()}"
)


@pytest.fixture
def block_cache():
    """The block cache installed in this process, as an engine installs it, emptied before and after."""
    heap._install()
    heap.release_kept_blocks()
    yield
    heap.release_kept_blocks()


def _counters_after(allocate) -> dict[str, int]:
    before = heap.block_cache_counters()
    allocate()
    after = heap.block_cache_counters()
    return {key: after[key] - before[key] for key in ("reused", "fresh", "not_kept")}


@needs_the_block_cache
def test_a_freed_block_comes_back_for_a_tensor_of_its_size_class(block_cache):
    """300,000 and 290,000 bytes share a class (eight per doubling: up to 327,680); 400,000 bytes do not."""
    first = torch.empty(300_000, dtype=torch.uint8)
    address = first.data_ptr()
    assert address % 64 == 0
    del first
    assert heap.block_cache_counters()["kept_bytes"] == 327_680
    second = torch.empty(290_000, dtype=torch.uint8)
    assert second.data_ptr() == address
    assert heap.block_cache_counters()["kept_bytes"] == 0
    other = torch.empty(400_000, dtype=torch.uint8)
    assert other.data_ptr() != address


@needs_the_block_cache
def test_a_request_whose_class_is_empty_takes_a_kept_block_up_to_twice_its_size(block_cache):
    """A freed block of class 655,360 serves 400,000 bytes (class 458,752) and goes back to its own class; it is
    too large for 200,000 bytes (class 229,376), which get a block of their own."""
    first = torch.empty(600_000, dtype=torch.uint8)
    address = first.data_ptr()
    del first
    assert _counters_after(lambda: torch.empty(200_000, dtype=torch.uint8)) == {"reused": 0, "fresh": 1, "not_kept": 0}
    heap.release_kept_blocks()
    first = torch.empty(600_000, dtype=torch.uint8)
    address = first.data_ptr()
    del first
    smaller = torch.empty(400_000, dtype=torch.uint8)
    assert smaller.data_ptr() == address
    del smaller
    assert heap.block_cache_counters()["kept_bytes"] == 655_360


@needs_the_block_cache
def test_blocks_too_large_to_keep_go_back_to_the_c_library(block_cache):
    def large() -> None:
        torch.empty(heap.LARGEST_KEPT_BLOCK + 1, dtype=torch.uint8)

    assert _counters_after(large) == {"reused": 0, "fresh": 0, "not_kept": 1}
    assert heap.block_cache_counters()["kept_bytes"] == 0


@needs_the_block_cache
def test_the_kept_bytes_stay_within_their_limit_and_are_released(block_cache):
    """Twenty blocks of 60 MiB (never written, so never resident) freed at once: only what fits the limit is kept."""
    blocks = [torch.empty(60 << 20, dtype=torch.uint8) for _ in range(20)]
    del blocks
    kept = heap.block_cache_counters()["kept_bytes"]
    assert heap.KEPT_BYTES_LIMIT - (64 << 20) < kept <= heap.KEPT_BYTES_LIMIT
    assert heap.release_kept_blocks() == kept
    assert heap.block_cache_counters()["kept_bytes"] == 0


@needs_the_block_cache
def test_tensors_from_kept_blocks_compute_what_fresh_ones_do_across_threads(block_cache):
    """Four threads allocate and free products of many sizes at once; each result matches float64's."""
    generator = torch.Generator().manual_seed(0)
    cases = [
        (torch.randn(rows, 96, generator=generator), torch.randn(96, cols, generator=generator))
        for rows, cols in [(1, 7), (3, 64), (17, 130), (64, 576), (128, 40)]
    ]
    expected = [(a.double() @ b.double()).sum().item() for a, b in cases]
    failures: list[str] = []

    def work(seed: int) -> None:
        for repeat in range(40):
            index = (seed + repeat) % len(cases)
            a, b = cases[index]
            got = (a @ b).sum().item()
            if abs(got - expected[index]) > 1e-3 * max(1.0, abs(expected[index])):
                failures.append(f"thread {seed}, case {index}: {got} != {expected[index]}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert heap.block_cache_counters()["reused"] > 0


SET_UP = """
import sys
from patchbay.worker.cpu import caching_allocator as heap
print(heap.set_up_heap(sys.argv[1]))
print(heap.caching_allocator_installed())
"""


@needs_the_block_cache
@pytest.mark.parametrize("allocator, installed", [("caching", True), ("system", False)])
def test_the_setting_chooses_the_processs_allocator_and_the_summary_says_which(allocator, installed):
    heap.EXTENSION.load()  # built, as the Makefile builds it
    result = subprocess.run([sys.executable, "-c", SET_UP, allocator], capture_output=True, text=True, check=True)
    summary, flag = result.stdout.strip().splitlines()
    assert flag == str(installed), result.stderr
    assert ("patchbay's block cache" in summary) == installed, summary


@needs_the_block_cache
def test_a_tensor_larger_than_memory_is_an_error_naming_the_block_cache(block_cache):
    with pytest.raises(RuntimeError, match="patchbay's block cache: not enough memory for a tensor of"):
        torch.empty(1 << 62, dtype=torch.uint8)
