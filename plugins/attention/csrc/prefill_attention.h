// Declarations shared by the attention extension's sources (patchbay.plugins.attention._cpu_kernel).
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include "run_tasks.h"


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
