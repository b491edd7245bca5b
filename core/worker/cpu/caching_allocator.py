"""The process's heap set up for a step loop: freed memory stays mapped, and torch's CPU tensors reuse freed blocks.

By default glibc serves each allocation above a threshold (128 KiB, raised as
such blocks are freed, up to 32 MiB) with a fresh ``mmap``, and hands the top
of its heap back to the kernel once more than twice that threshold lies free
there.  A decode step allocates and frees the same large tensors every step
(a 64-request step's float32 logits are 12.6 MB, its products' outputs a few
hundred KB each), so every step faulted their pages in again: on the
development machine a 64-request bfloat16 decode step took 48 ms this way and
41 ms with the settings below (the logits' copy alone 2.6 ms against 0.3 ms).
vLLM-CPU gets the same effect from the tcmalloc its launcher preloads.

So an engine's process sets glibc's mmap threshold to its maximum (32 MiB:
the KV cache and the weights are still mapped apart) and its trim threshold
to 1 GiB.  Resident memory then stays at its high-water mark, which is what
the KV-cache sizing plans for anyway.  Nothing changes where the C library is
not glibc, where another allocator is preloaded (``LD_PRELOAD``), or where the
operator set glibc's own ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` environment variables.

On top of that, ``runtime.cpu_allocator: caching`` (the default) makes
patchbay's block cache torch's CPU allocator, for the whole process
(``csrc/host_allocator.cpp``): glibc serves torch's 64-byte-aligned requests
through ``memalign``, whose search of its free chunks took ~6 % of a
64-request W8A8 decode's samples; the cache hands a freed block of the same
size class straight back (else one of up to twice the size, so that a step of
a new size reuses resident memory).  It keeps at most :data:`KEPT_BYTES_LIMIT` of freed
blocks, none larger than :data:`LARGEST_KEPT_BLOCK` (weights and KV pools
come from the C library), and :func:`release_kept_blocks` hands them back.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

from pathlib import Path

from patchbay.toolkit.native_build import BackgroundBuild, NativeExtension, build_at_install, build_unavailable

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""glibc's largest mmap threshold on 64-bit machines."""
TRIM_THRESHOLD = 1 << 30

OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

KEPT_BYTES_LIMIT = 512 << 20
"""The most bytes of freed blocks the caching allocator keeps; a block freed beyond it goes back to the C library."""
LARGEST_KEPT_BLOCK = 64 << 20
"""Larger blocks (weights, a layer's KV pool, a long prefill's logits) come from the C library and go back to it."""

SOURCE = Path(__file__).resolve().parent / "csrc" / "host_allocator.cpp"
"""The allocator's C++ (the worker's own, not a toolkit kernel)."""
EXTENSION = NativeExtension("patchbay_host_allocator", (SOURCE,))


@functools.cache
def keep_freed_memory() -> str:
    """Set the process's glibc thresholds (once); say what was done, for the run summary."""
    chosen = [name for name in OPERATOR_SETTINGS if name in os.environ]
    if chosen:
        return f"glibc thresholds as the environment sets them ({', '.join(chosen)})"
    if os.environ.get("LD_PRELOAD"):
        return f"the preloaded allocator's ({os.environ['LD_PRELOAD']})"
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "the C library's defaults (not glibc)"
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "glibc's defaults (mallopt refused the thresholds)"
    return "freed memory kept for the next step (glibc mmap threshold 32 MiB, trim threshold 1 GiB)"


def set_up_heap(allocator: str) -> str:
    """Set up the process's heap for a step loop, with ``runtime.cpu_allocator`` (``caching`` or ``system``);
    say how, for the run summary.  ``caching`` installs the block cache once per process, now where its
    extension is built, else from a background build (torch allocates from the C library until then)."""
    glibc = keep_freed_memory()
    if allocator == "caching" and not caching_allocator_installed():
        reason = build_unavailable()
        if reason is not None:
            return f"torch's CPU tensors from the C library (no block cache: {reason}); {glibc}"
        if not EXTENSION.is_built():
            HostAllocatorBuild.shared()
            return f"torch's CPU tensors from the C library until patchbay's block cache is built; {glibc}"
        _install()
    if caching_allocator_installed():
        return f"torch's CPU tensors from patchbay's block cache ({_limits()}); {glibc}"
    return f"torch's CPU tensors from the C library; {glibc}"


def caching_allocator_installed() -> bool:
    """Whether torch's CPU allocator is patchbay's block cache in this process."""
    return _module is not None and bool(_module.installed())


def release_kept_blocks() -> int:
    """Hand the block cache's freed blocks back to the C library (an engine closing, a memory measurement);
    the bytes they held (0 where the cache is not installed)."""
    return int(_module.release_kept_blocks()) if _module is not None else 0


def block_cache_counters() -> dict[str, int]:
    """The block cache's bytes kept and how many allocations it served from kept blocks, fresh from the C
    library, and straight from it (too large to keep); all 0 where it is not installed."""
    values = _module.counters() if _module is not None else [0, 0, 0, 0]
    return dict(zip(("kept_bytes", "reused", "fresh", "not_kept"), values, strict=True))


def _limits() -> str:
    return f"up to {KEPT_BYTES_LIMIT >> 20} MiB of freed blocks of up to {LARGEST_KEPT_BLOCK >> 20} MiB kept"


_module: Any = None
"""The loaded extension, once :func:`_install` ran."""


@functools.cache
def _install() -> Any:
    global _module
    module = EXTENSION.load()
    if not module.install(KEPT_BYTES_LIMIT, LARGEST_KEPT_BLOCK):
        logger.warning("torch kept another CPU allocator set with a higher priority; patchbay's block cache is unused")
    _module = module
    return module


class HostAllocatorBuild(BackgroundBuild):
    """Builds the block cache in a background thread and installs it once built."""

    def __init__(self) -> None:
        super().__init__(_install, "the caching CPU allocator")


def main() -> int:
    """Build the block cache now (the Makefile runs this at install time); exit 0 also where it cannot be built."""
    return build_at_install(EXTENSION.load, "the caching CPU allocator", EXTENSION.build_directory)


if __name__ == "__main__":
    raise SystemExit(main())
