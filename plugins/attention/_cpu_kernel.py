"""C++ kernels for attention straight over the paged cache, and for long prefills through AMX, built once per install.

Each query token (a decode's, a draft's, or one of a short prefill's, whose
keys the step has already written) attends the keys up to itself on its own.

Gathering each request's blocks into a padded tensor and running SDPA over it
moves every cached key and value three times (read and write for the gather,
read for the attention) and attends padding too; this kernel reads each
cached key and value once, in place, in one call per layer, for float32 and
bfloat16 caches (bfloat16 is widened to float32 as it is read; the arithmetic
is float32, and the products of bfloat16 keys and queries, exact in float32,
run as AVX512-BF16 pair dot products where the CPU has them).  On x86 CPUs with
AVX-512, or AVX2 and FMA, head sizes that are a multiple of the register width
run a SIMD path (the query and the value accumulators held in registers, four
keys' dot products reduced by one add tree, each value row weighed for several
query heads at once); other shapes and CPUs run plain loops.  The SIMD path
reads each key and value once: a task runs over one query's keys 128 at a
time for every KV head, folding each pass into a running softmax, and a query
of thousands of keys in a step of few queries is split between tasks whose
shares are merged.  The tasks run on the tiled products' helper threads, as
many as the products use, where the process has them
(:func:`patchbay.toolkit.tiles.chunk_runner`), else over OpenMP.
The extension also writes a step's new keys and values into
the cache, one call per layer (``write_kv``), and in a step the kernel attends
whole does both in one call (``write_kv_and_attend``).  Where the CPU has AMX
bfloat16 tiles, it also attends long bfloat16 prefill chunks of head size 64
(``amx_prefill_attention``, in ``csrc/prefill_attention.cpp``): a task is one
query head's 16 rows against every key they see, its output held in tile
registers throughout.  It is built like every
patchbay extension (:mod:`patchbay.toolkit.native_build`): by ``make`` at
install time (``python -m patchbay.plugins.attention._cpu_kernel``), elsewhere
by :class:`KernelBuild` in a background thread while decodes run through SDPA;
:func:`kernel_unavailable` says why it cannot be.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any

from patchbay.toolkit.native_build import (
    CSRC,
    NATIVE_CFLAGS,
    BackgroundBuild,
    NativeExtension,
    build_at_install,
    build_unavailable,
)

logger = logging.getLogger(__name__)

EXTRA_CFLAGS = (*NATIVE_CFLAGS, "-ffast-math")
"""The kernel's compiler flags: fast math lets the compiler vectorize its softmax's exponentials and sums."""

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"
"""The kernel's C++ (package data); it includes the worker's shared SIMD header, in
:data:`patchbay.toolkit.native_build.CSRC`."""
PREFILL_SOURCE = SOURCE.with_name("prefill_attention.cpp")
"""The long prefills' AMX kernel, in the same extension (``amx_prefill_attention``; see ``torch_sdpa``)."""


def extension() -> NativeExtension:
    """The kernel as a :class:`NativeExtension` (its flags read now, so a test can change them)."""
    return NativeExtension("patchbay_paged_decode", (SOURCE, PREFILL_SOURCE), EXTRA_CFLAGS, (CSRC,))


def kernel_unavailable() -> str | None:
    """Why the kernel cannot be built here (``None`` when it can)."""
    return build_unavailable()


def build_name() -> str:
    """The extension's name: it changes with the source, the flags, the torch version and installation, and the CPU."""
    return extension().build_name()


def build_directory() -> Path:
    """Where this installation's kernel is built: patchbay's cache directory, one folder per :func:`build_name`."""
    return extension().build_directory()


@functools.cache
def load_kernel() -> Any:
    """Build the extension (once per installation and CPU: it is cached in :func:`build_directory`) and import it."""
    reason = kernel_unavailable()
    if reason is not None:
        raise RuntimeError(f"cannot build the paged decode kernel: {reason}")
    return extension().load()


class KernelBuild(BackgroundBuild):
    """:func:`load_kernel` in a background thread (see :class:`~patchbay.toolkit.native_build.BackgroundBuild`)."""

    def __init__(self) -> None:
        super().__init__(lambda: load_kernel(), "the C++ decode kernel")


def main() -> int:
    """Build the kernel now (the Makefile runs this at install time); exit 0 also when it cannot be built here."""
    return build_at_install(load_kernel, "the paged decode kernel", build_directory)


if __name__ == "__main__":
    sys.exit(main())
