"""A C++ kernel for single-token (decode) attention straight over the paged cache, built on first use.

Gathering each request's blocks into a padded tensor and running SDPA over it
moves every cached key and value three times (read and write for the gather,
read for the attention) and attends padding too; this kernel reads each
cached key and value once, in place, in one OpenMP region per layer.  It is
compiled with ``torch.utils.cpp_extension`` (needs a C++ compiler and
``ninja``) into torch's extension cache the first time a process asks for it;
:func:`kernel_unavailable` says why it cannot be.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
from typing import Any

SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <vector>

// query, output: [tokens, heads, head_size]; key_cache, value_cache: [blocks, block_size, kv_heads, head_size];
// block_table: int32 [requests, max_blocks]; seq_lens: int32 [requests], keys per request (the new one
// included); rows: int64 [requests], each request's query row; window: 0, or the sliding window.
void paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor rows,
                            double scale, int64_t window, torch::Tensor output) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32
              && value_cache.scalar_type() == torch::kFloat32 && output.scalar_type() == torch::kFloat32,
              "paged_decode_attention runs on float32");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32
              && rows.scalar_type() == torch::kInt64, "int32 block table and lengths, int64 rows expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && query.is_contiguous()
              && output.is_contiguous() && block_table.is_contiguous(), "contiguous tensors expected");
  const int64_t requests = rows.size(0);
  const int64_t heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_table.size(1);
  const float* q_base = query.data_ptr<float>();
  const float* k_base = key_cache.data_ptr<float>();
  const float* v_base = value_cache.data_ptr<float>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  float* out_base = output.data_ptr<float>();
  const int64_t token_stride = kv_heads * head_size, block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t r = 0; r < requests; ++r) {
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      const int64_t seq_len = lens[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
      const int64_t n = seq_len - first;
      const float* q = q_base + (row_of[r] * heads + kvh * group) * head_size;
      float* out = out_base + (row_of[r] * heads + kvh * group) * head_size;
      const int32_t* blocks = table + r * max_blocks;
      // Pass 1: every score of the query heads sharing this KV head, block by block (keys read once).
      std::vector<float> scores(group * n);
      for (int64_t pos = first; pos < seq_len;) {
        const int64_t block = pos / block_size, offset = pos % block_size;
        const int64_t count = std::min(block_size - offset, seq_len - pos);
        const float* k = k_base + blocks[block] * block_stride + offset * token_stride + kvh * head_size;
        for (int64_t j = 0; j < count; ++j, k += token_stride) {
          for (int64_t g = 0; g < group; ++g) {
            const float* __restrict qg = q + g * head_size;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_size; ++d) dot += qg[d] * k[d];
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
        const float* v = v_base + blocks[block] * block_stride + offset * token_stride + kvh * head_size;
        for (int64_t j = 0; j < count; ++j, v += token_stride) {
          for (int64_t g = 0; g < group; ++g) {
            const float weight = scores[g * n + pos - first + j];
            float* __restrict o = sums.data() + g * head_size;
            const float* __restrict vv = v;
#pragma omp simd
            for (int64_t d = 0; d < head_size; ++d) o[d] += weight * vv[d];
          }
        }
        pos += count;
      }
      std::copy(sums.begin(), sums.end(), out);
    }
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


@functools.cache
def load_kernel() -> Any:
    """Build the extension (the first time on a machine: torch caches it) and import it."""
    from torch.utils.cpp_extension import load_inline

    reason = kernel_unavailable()
    if reason is not None:
        raise RuntimeError(f"cannot build the paged decode kernel: {reason}")
    return load_inline(
        name="patchbay_paged_decode_v4",
        cpp_sources=[SOURCE],
        functions=["paged_decode_attention"],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
