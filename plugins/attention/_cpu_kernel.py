"""A C++ kernel for single-token (decode) attention straight over the paged cache, built once per install.

Gathering each request's blocks into a padded tensor and running SDPA over it
moves every cached key and value three times (read and write for the gather,
read for the attention) and attends padding too; this kernel reads each
cached key and value once, in place, in one OpenMP region per layer, for
float32 and bfloat16 caches (bfloat16 is widened to float32 as it is read; the
arithmetic is float32).  It is compiled with ``torch.utils.cpp_extension``
(needs a C++ compiler and ``ninja``) into patchbay's cache directory, in a
folder keyed by the source, the flags, the torch version and the torch
installation, so two virtual environments never rebuild each other's copy.
``make`` builds it at install time (``python -m patchbay.plugins.attention._cpu_kernel``);
elsewhere :class:`KernelBuild` builds it in a background thread while decodes
run through SDPA.  :func:`kernel_unavailable` says why it cannot be.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STALE_LOCK_SECONDS = 600.0
"""A build lock older than this was left by a process killed mid-build (a build takes well under a minute)."""
EXTRA_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")

SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <vector>

// query, output: [tokens, heads, head_size]; key_cache, value_cache: [blocks, block_size, kv_heads, head_size];
// block_table: int32 [requests, max_blocks]; seq_lens: int32 [requests], keys per request (the new one
// included); rows: int64 [requests], each request's query row; window: 0, or the sliding window.
template <typename scalar_t>
void decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                      const torch::Tensor& block_table, const torch::Tensor& seq_lens, const torch::Tensor& rows,
                      double scale, int64_t window, torch::Tensor& output) {
  const int64_t requests = rows.size(0);
  const int64_t heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_table.size(1);
  const scalar_t* q_base = query.data_ptr<scalar_t>();
  const scalar_t* k_base = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_base = value_cache.data_ptr<scalar_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  scalar_t* out_base = output.data_ptr<scalar_t>();
  const int64_t token_stride = kv_heads * head_size, block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t r = 0; r < requests; ++r) {
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      const int64_t seq_len = lens[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
      const int64_t n = seq_len - first;
      const scalar_t* q_in = q_base + (row_of[r] * heads + kvh * group) * head_size;
      scalar_t* out = out_base + (row_of[r] * heads + kvh * group) * head_size;
      const int32_t* blocks = table + r * max_blocks;
      std::vector<float> q(q_in, q_in + group * head_size);  // the query heads of this KV head, as float32
      // Pass 1: every score of the query heads sharing this KV head, block by block (keys read once).
      std::vector<float> scores(group * n);
      for (int64_t pos = first; pos < seq_len;) {
        const int64_t block = pos / block_size, offset = pos % block_size;
        const int64_t count = std::min(block_size - offset, seq_len - pos);
        const scalar_t* k = k_base + blocks[block] * block_stride + offset * token_stride + kvh * head_size;
        for (int64_t j = 0; j < count; ++j, k += token_stride) {
          for (int64_t g = 0; g < group; ++g) {
            const float* __restrict qg = q.data() + g * head_size;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_size; ++d) dot += qg[d] * static_cast<float>(k[d]);
            scores[g * n + pos - first + j] = dot * fscale;
          }
        }
        pos += count;
      }
      // Softmax per query head: scores are finite (nothing is masked), so fast math is safe.
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        float top = sg[0];
        for (int64_t i = 1; i < n; ++i) top = std::max(top, sg[i]);
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = std::exp(sg[i] - top);
          total += sg[i];
        }
        const float inverse = 1.0f / total;
        for (int64_t i = 0; i < n; ++i) sg[i] *= inverse;
      }
      // Pass 2: the weighted sum of values, block by block (values read once), in a local accumulator.
      std::vector<float> sums(group * head_size, 0.0f);
      for (int64_t pos = first; pos < seq_len;) {
        const int64_t block = pos / block_size, offset = pos % block_size;
        const int64_t count = std::min(block_size - offset, seq_len - pos);
        const scalar_t* v = v_base + blocks[block] * block_stride + offset * token_stride + kvh * head_size;
        for (int64_t j = 0; j < count; ++j, v += token_stride) {
          for (int64_t g = 0; g < group; ++g) {
            const float weight = scores[g * n + pos - first + j];
            float* __restrict o = sums.data() + g * head_size;
            const scalar_t* __restrict vv = v;
#pragma omp simd
            for (int64_t d = 0; d < head_size; ++d) o[d] += weight * static_cast<float>(vv[d]);
          }
        }
        pos += count;
      }
      for (int64_t i = 0; i < group * head_size; ++i) out[i] = static_cast<scalar_t>(sums[i]);
    }
  }
}

// query, output: [tokens, heads, head_size]; key_cache, value_cache: [blocks, block_size, kv_heads, head_size],
// all float32 or all bfloat16; block_table: int32 [requests, max_blocks]; seq_lens: int32 [requests], keys per
// request (the new one included); rows: int64 [requests], each request's query row; window: 0, or the window.
void paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor rows,
                            double scale, int64_t window, torch::Tensor output) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && key_cache.scalar_type() == dtype
              && value_cache.scalar_type() == dtype && output.scalar_type() == dtype,
              "paged_decode_attention runs on float32 or bfloat16, one dtype for query, caches and output");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32
              && rows.scalar_type() == torch::kInt64, "int32 block table and lengths, int64 rows expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && query.is_contiguous()
              && output.is_contiguous() && block_table.is_contiguous(), "contiguous tensors expected");
  if (dtype == torch::kFloat32) {
    decode_attention<float>(query, key_cache, value_cache, block_table, seq_lens, rows, scale, window, output);
  } else {
    decode_attention<at::BFloat16>(query, key_cache, value_cache, block_table, seq_lens, rows, scale, window,
                                   output);
  }
}
"""


@functools.cache
def kernel_unavailable() -> str | None:
    """Why the kernel cannot be built here (``None`` when it can)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) on PATH to build the kernel"
    if importlib.util.find_spec("ninja") is None:
        return "the ninja package is not installed (torch builds C++ extensions with it)"
    return None


def build_name() -> str:
    """The extension's name: it changes with the source, the flags, the torch version and the torch installation."""
    import torch

    key = "\0".join([SOURCE, *EXTRA_CFLAGS, torch.__version__, str(Path(torch.__file__).parent)])
    return f"patchbay_paged_decode_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build_directory() -> Path:
    """Where this installation's kernel is built: patchbay's cache directory, one folder per :func:`build_name`."""
    from patchbay.worker.model_loader import cache_dir

    return cache_dir() / "kernels" / f"py{sys.version_info.major}{sys.version_info.minor}" / build_name()


def _clear_stale_lock(directory: Path) -> None:
    # torch's builder holds a lock file in the build folder while it compiles; a process killed mid-build
    # leaves it behind, and every later build would wait on it forever.
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing the decode kernel's build lock %s, left %.0f s ago by a build that never finished",
                       lock, age)
        lock.unlink(missing_ok=True)


def _finished(built: Path, lock: Path) -> bool:
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


def _wait_for_other_builds(directory: Path) -> None:
    """Wait while another process holds the folder's build lock, until it is released or found stale."""
    lock = directory / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS:
            return
        time.sleep(0.2)


def _import_built(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_kernel() -> Any:
    """Build the extension (once per installation: it is cached in :func:`build_directory`) and import it."""
    from torch.utils.cpp_extension import load_inline

    reason = kernel_unavailable()
    if reason is not None:
        raise RuntimeError(f"cannot build the paged decode kernel: {reason}")
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    built = directory / f"{build_name()}.so"
    # Built already (the folder's name pins source, flags and torch): import it without torch's builder, which
    # takes its lock even to find nothing to do, so a process killed at that moment (a rank a test or an
    # operator kills) left a lock every later start waited on for ever.
    if _finished(built, directory / "lock"):
        return _import_built(built)
    _wait_for_other_builds(directory)
    _clear_stale_lock(directory)
    if _finished(built, directory / "lock"):
        return _import_built(built)
    return load_inline(
        name=build_name(),
        cpp_sources=[SOURCE],
        functions=["paged_decode_attention"],
        extra_cflags=list(EXTRA_CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=False,
    )


class KernelBuild:
    """:func:`load_kernel` in a background thread, so the first requests of a fresh install never wait on it.

    :meth:`ready` returns the kernel once built and ``None`` until then (and
    for good if the build failed: :attr:`error` says why, logged once).
    """

    _lock = threading.Lock()
    _shared: KernelBuild | None = None

    def __init__(self) -> None:
        self.kernel: Any = None
        self.error: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._build, name="patchbay-decode-kernel-build", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> KernelBuild:
        """The one build of this process, started on first call."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _build(self) -> None:
        try:
            self.kernel = load_kernel()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("the C++ decode kernel could not be built (decodes keep using SDPA): %s", self.error)
        finally:
            self._done.set()

    def ready(self) -> Any:
        """The kernel if it is built, else ``None`` (never waits)."""
        return self.kernel if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> Any:
        """The kernel once the build ends (``None`` if it failed or ``timeout`` passed first)."""
        self._done.wait(timeout)
        return self.ready()


def main() -> int:
    """Build the kernel now (the Makefile runs this at install time); exit 0 also when it cannot be built here."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = kernel_unavailable()
    if reason is not None:
        logger.info("the paged decode kernel is not built: %s", reason)
        return 0
    started = time.perf_counter()
    load_kernel()
    logger.info("paged decode kernel ready in %s (%.1f s)", build_directory(), time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
