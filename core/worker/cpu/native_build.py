"""Building patchbay's C++ extensions once per installation and CPU, and loading them without waiting.

Each extension (:class:`NativeExtension`) is compiled with
``torch.utils.cpp_extension`` (a C++ compiler and ``ninja`` are needed) into
patchbay's cache directory, in a folder named by a hash of the source, the
compiler flags, the torch version, the torch installation and the CPU's model
and flags: ``-march=native`` code built on one CPU may not run on another
sharing the cache directory, and two virtual environments never rebuild each
other's copy.  ``make`` builds them at install time; elsewhere
:class:`BackgroundBuild` builds one in a thread while the code that needs it
uses its plain torch path.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STALE_LOCK_SECONDS = 600.0
"""A build lock older than this was left by a process killed mid-build (a build takes well under a minute)."""

BUILDER_FILE = "builder"
"""The file in a build folder naming the host and process id of the last process that started a build there."""

NATIVE_CFLAGS = ("-O3", "-march=native", "-fopenmp")
"""Flags every extension is compiled with (an extension may add its own)."""


SIMD_HELPERS = r"""
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PATCHBAY_SIMD 1
#include <immintrin.h>
#include <c10/util/BFloat16.h>
// One SIMD register of floats (AVX-512: 16 lanes, AVX2: 8), loaded from float32 or bfloat16 (widened exactly)
// and stored to either (bfloat16 rounded to nearest even, as c10::BFloat16 rounds).
#if defined(__AVX512F__)
using vfloat = __m512;
constexpr int kLanes = 16;
static inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vfloat vload(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline void vstore(float* p, vfloat a) { _mm512_storeu_ps(p, a); }
static inline void vstore(c10::BFloat16* p, vfloat a) {
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
static inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
static inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
static inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
static inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
static inline vfloat vmin(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
static inline vfloat vbroadcast(float x) { return _mm512_set1_ps(x); }
static inline vfloat vround(vfloat a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vfloat vexp2i(vfloat n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline float vsum(vfloat a) { return _mm512_reduce_add_ps(a); }
static inline vfloat vround_bf16(vfloat a) {  // a rounded to bfloat16's precision, as floats
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#else
using vfloat = __m256;
constexpr int kLanes = 8;
static inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vfloat vload(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
static inline void vstore(float* p, vfloat a) { _mm256_storeu_ps(p, a); }
static inline void vstore(c10::BFloat16* p, vfloat a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i high = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  // Pack the eight 16-bit halves: packus works within 128-bit lanes, so gather the two lanes' results first.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
static inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
static inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
static inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
static inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
static inline vfloat vmin(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
static inline vfloat vbroadcast(float x) { return _mm256_set1_ps(x); }
static inline vfloat vround(vfloat a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vfloat vexp2i(vfloat n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline float vsum(vfloat a) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}
static inline vfloat vround_bf16(vfloat a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif
// Rounded to the precision of the type a pointer points to (float32: unchanged).
static inline vfloat vround_as(const float*, vfloat a) { return a; }
static inline vfloat vround_as(const c10::BFloat16*, vfloat a) { return vround_bf16(a); }
// e^x in float32 within about two units in the last place: x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// degree-6 Taylor polynomial, times 2^n.  Inputs are clamped to where e^x is a normal float (or rounds to 0).
static inline vfloat vexp(vfloat x) {
  x = vmin(vmax(x, vbroadcast(-87.33f)), vbroadcast(88.72f));
  const vfloat n = vround(vmul(x, vbroadcast(1.44269504f)));
  vfloat r = vfma(n, vbroadcast(-0.693145752f), x);
  r = vfma(n, vbroadcast(-1.42860677e-6f), r);
  vfloat p = vbroadcast(1.0f / 720.0f);
  p = vfma(p, r, vbroadcast(1.0f / 120.0f));
  p = vfma(p, r, vbroadcast(1.0f / 24.0f));
  p = vfma(p, r, vbroadcast(1.0f / 6.0f));
  p = vfma(p, r, vbroadcast(0.5f));
  p = vfma(p, r, vbroadcast(1.0f));
  p = vfma(p, r, vbroadcast(1.0f));
  return vmul(p, vexp2i(n));
}
#endif
"""
"""C++ shared by patchbay's kernels: a float register type over AVX-512 or AVX2 (``PATCHBAY_SIMD`` is defined
where one of them is available) with float32 and bfloat16 loads and stores and a vectorized exponential."""


@functools.cache
def build_unavailable() -> str | None:
    """Why no extension can be built here (``None`` when they can)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) on PATH to build the kernel"
    if importlib.util.find_spec("ninja") is None:
        return "the ninja package is not installed (torch builds C++ extensions with it)"
    return None


@dataclass(frozen=True)
class NativeExtension:
    """One C++ extension: its name prefix, source, exported functions and compiler flags."""

    prefix: str
    source: str
    functions: tuple[str, ...]
    cflags: tuple[str, ...] = NATIVE_CFLAGS

    def build_name(self) -> str:
        """The module's name: the prefix and a hash of what the built code depends on."""
        import torch

        from patchbay.worker.cpu.tuning import CpuInfo

        cpu = CpuInfo.read()
        key = "\0".join([self.source, *self.cflags, torch.__version__, str(Path(torch.__file__).parent),
                         cpu.model_name, *sorted(cpu.flags)])
        return f"{self.prefix}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"

    def build_directory(self) -> Path:
        """Where this installation builds it: patchbay's cache directory, one folder per :meth:`build_name`."""
        from patchbay.worker.model.model_loader import cache_dir

        return cache_dir() / "kernels" / f"py{sys.version_info.major}{sys.version_info.minor}" / self.build_name()

    def without_avx512(self) -> NativeExtension:
        """The same extension built without AVX-512 (its AVX2 path, where the CPU has AVX2): for tests of the
        path CPUs without AVX-512 run, on a CPU that has both."""
        return dataclasses.replace(self, cflags=(*self.cflags, "-mno-avx512f"))

    def load(self) -> Any:
        """The built module: imported if built already, else built now (waiting for another process's build)."""
        reason = build_unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot build {self.prefix}: {reason}")
        directory = self.build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        built = directory / f"{self.build_name()}.so"
        lock = directory / "lock"
        # Built already (the folder's name pins source, flags, torch and CPU): import it without torch's builder,
        # which takes its lock even to find nothing to do, so a process killed at that moment (a rank a test or
        # an operator kills) left a lock every later start waited on for ever.
        if finished(built, lock):
            return import_built(built)
        wait_for_other_builds(directory)
        clear_stale_lock(directory)
        if finished(built, lock):
            return import_built(built)
        (directory / BUILDER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")
        from torch.utils.cpp_extension import load_inline

        return load_inline(name=self.build_name(), cpp_sources=[self.source], functions=list(self.functions),
                           extra_cflags=list(self.cflags), extra_ldflags=["-fopenmp"],
                           build_directory=str(directory), verbose=False)


def clear_stale_lock(directory: Path) -> None:
    """Remove ``directory``'s build lock if its builder died: it is older than :data:`STALE_LOCK_SECONDS`, or
    the process that took it (on this machine) no longer runs."""
    # torch's builder holds a lock file in the build folder while it compiles; a process killed mid-build
    # leaves it behind, and every later build would wait on it forever.
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS or builder_gone(directory):
        logger.warning("removing the build lock %s, left %.0f s ago by a build that never finished", lock, age)
        lock.unlink(missing_ok=True)


def builder_gone(directory: Path) -> bool:
    """Whether the process that last started a build in ``directory`` ran on this machine and has exited (a
    process that exits during a background build, or is killed mid-build, leaves torch's lock behind)."""
    try:
        host, pid = (directory / BUILDER_FILE).read_text().split()
        if host != socket.gethostname():
            return False  # a cache folder shared between machines: only the lock's age tells
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):
        return False
    return False


def finished(built: Path, lock: Path) -> bool:
    """Whether the library is complete: it exists and no build lock was taken before it was written (a lock
    taken after it is a builder checking that nothing needs doing, or one killed while it checked)."""
    try:
        written = built.stat().st_mtime
    except FileNotFoundError:
        return False
    try:
        return lock.stat().st_mtime >= written
    except FileNotFoundError:
        return True


def wait_for_other_builds(directory: Path) -> None:
    """Wait while another process holds the folder's build lock, until it is released or found stale."""
    lock = directory / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS or builder_gone(directory):
            return
        time.sleep(0.2)


def import_built(path: Path) -> Any:
    """Import the extension module at ``path``."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BackgroundBuild:
    """``load()`` in a background thread, so a fresh install's first requests never wait on a compiler.

    :meth:`ready` returns the module once built and ``None`` until then (and
    for good if the build failed: :attr:`error` says why, logged once).
    A subclass whose ``__init__`` takes no arguments has one shared build per
    process, :meth:`shared`.
    """

    _shared_lock = threading.Lock()

    def __init__(self, load: Callable[[], Any], what: str) -> None:
        """Start building; ``what`` names the extension in the log (``the C++ decode kernel``)."""
        self.kernel: Any = None
        self.error: str | None = None
        self.what = what
        self._load = load
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._build, name=f"patchbay-build {what}", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            self.kernel = self._load()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("%s could not be built (its torch path keeps serving): %s", self.what, self.error)
        finally:
            self._done.set()

    def ready(self) -> Any:
        """The module if it is built, else ``None`` (never waits)."""
        return self.kernel if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> Any:
        """The module once the build ends (``None`` if it failed or ``timeout`` passed first)."""
        self._done.wait(timeout)
        return self.ready()

    @classmethod
    def shared(cls) -> Any:
        """The one build of this subclass in this process, started on first call."""
        with BackgroundBuild._shared_lock:
            found = cls.__dict__.get("_instance")
            if found is None:
                found = cls()
                cls._instance = found
            return found


def build_at_install(load: Callable[[], Any], what: str, directory: Callable[[], Path]) -> int:
    """Build ``what`` now and log where (the Makefile runs this at install time, so a fresh install's first
    request never waits on a compiler); exit status 0 also where nothing can be built here."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = build_unavailable()
    if reason is not None:
        logger.info("%s is not built: %s", what, reason)
        return 0
    started = time.perf_counter()
    load()
    logger.info("%s ready in %s (%.1f s)", what, directory(), time.perf_counter() - started)
    return 0
