// Declarations shared by the attention extension's sources (patchbay.plugins.attention._cpu_kernel).
#pragma once
#include <torch/extension.h>
#include <cstdint>

// A pool's entry point (patchbay.toolkit.tiles.chunk_runner): runs work(context, i) for every i in
// [0, chunks) over the calling thread and threads - 1 helpers.
using RunChunks = void (*)(int threads, int64_t chunks, void (*work)(const void*, int64_t), const void* context);

// task(i) for every i in [0, tasks): on the caller's pool where it passed one (its helpers are awake between the
// step's products, where OpenMP's sleeping threads would have to be woken and then contend with them for the
// cores), else over OpenMP.
template <typename Task>
void run_tasks(RunChunks pool, int threads, int64_t tasks, const Task& task) {
  if (pool != nullptr && threads > 1) {
    pool(threads, tasks, [](const void* context, int64_t i) { (*static_cast<const Task*>(context))(i); }, &task);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < tasks; ++i) task(i);
}

// Whether amx_prefill_attention runs here: built for AMX with bfloat16 tiles and AVX512-BF16, and the process
// was granted the tile data.
bool amx_prefill_supported();

// Causal attention of one prefill chunk after context_len cached tokens, through AMX tiles, in bfloat16 with
// float32 scores and sums.  query: [q_len, heads, 64]; keys, values: [context_len + q_len, kv_heads, 64] (the
// cached keys, then the chunk's own); all bfloat16 with unit stride along the head, any other strides; query
// row i attends keys 0 .. context_len + i.  Query heads share KV heads in order.  Writes output [q_len, heads,
// 64] (bfloat16, unit stride along the head).  chunk_runner: a pool's entry point (RunChunks) run on `threads`
// threads, or 0 for torch's.
void amx_prefill_attention(torch::Tensor query, torch::Tensor keys, torch::Tensor values, int64_t context_len,
                           double scale, torch::Tensor output, int64_t chunk_runner, int64_t threads);
