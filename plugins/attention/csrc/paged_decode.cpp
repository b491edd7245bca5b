// Attention of single query tokens straight over the paged KV cache (patchbay.plugins.attention._cpu_kernel).
#include <torch/extension.h>
#include <cstring>
#include "simd.h"
#include "prefill_attention.h"
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

// Shapes, for both paths: query [tokens, heads, head_size], any strides; output the same, contiguous;
// key_cache, value_cache: [blocks, block_size, kv_heads, row]: a row is head_size features in the query's dtype
// (float32 or bfloat16), or, in an int8 cache, head_size int8 levels then their float32 scale (head_size + 4
// bytes, patchbay.interfaces.int8_kv's format; features are widened to float32 as they are read and the scale
// applied to each dot product and value weight); block_table: int32 [requests, max_blocks];
// then per query (a decode's one token, or each token of a short prefill or a draft): seq_lens: int32, the keys
// it attends (itself included); rows: int64, its query row; table_rows: int64, its request's block-table row;
// window: 0, or the sliding window.
// RunChunks, a pool's entry point, and run_tasks: prefill_attention.h.

struct Problem {
  int64_t requests, heads, head_size, row_size, block_size, kv_heads, group, max_blocks;
  int64_t q_token_stride, q_head_stride, token_stride, block_stride, window;
  const int32_t* table;
  const int32_t* lens;
  const int64_t* row_of;
  const int64_t* table_row_of;
  float scale;
  RunChunks run_chunks;
  int threads;

  Problem(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& block_table,
          const torch::Tensor& seq_lens, const torch::Tensor& rows, const torch::Tensor& table_rows, double scale_,
          int64_t window_, int64_t chunk_runner, int64_t threads_)
      : requests(rows.size(0)), heads(query.size(1)), head_size(query.size(2)), row_size(key_cache.size(3)),
        block_size(key_cache.size(1)), kv_heads(key_cache.size(2)), group(query.size(1) / key_cache.size(2)),
        max_blocks(block_table.size(1)),
        q_token_stride(query.stride(0)), q_head_stride(query.stride(1)),
        token_stride(key_cache.size(2) * row_size), block_stride(key_cache.size(1) * token_stride), window(window_),
        table(block_table.data_ptr<int32_t>()), lens(seq_lens.data_ptr<int32_t>()),
        row_of(rows.data_ptr<int64_t>()), table_row_of(table_rows.data_ptr<int64_t>()),
        scale(static_cast<float>(scale_)), run_chunks(reinterpret_cast<RunChunks>(chunk_runner)),
        threads(static_cast<int>(threads_)) {}

  int64_t first_key(int64_t r) const { return window > 0 ? std::max<int64_t>(0, lens[r] - window) : 0; }
};

// Cache rows hold their features (float32 or bfloat16, read as they are), or int8 levels and then the float32
// scale that turns them into features: the kernels dot and weigh the levels and apply the scale once per row.
template <typename cache_t>
constexpr bool kScaledRows = std::is_same<cache_t, int8_t>::value;
constexpr int64_t kScaleBytes = sizeof(float);  // after an int8 row's levels
constexpr float kLevels = 127.0f;               // an int8 level's largest magnitude (-128 unused: symmetric)

// The factor a cache row's features are multiplied by: 1, or an int8 row's scale, copied out because a row
// of head_size + 4 bytes leaves it unaligned.
template <typename cache_t>
static inline float row_scale(const cache_t* row, int64_t head_size) {
  if constexpr (kScaledRows<cache_t>) {
    float scale;
    std::memcpy(&scale, row + head_size, sizeof scale);
    return scale;
  } else {
    return 1.0f;
  }
}

template <typename Task>
static void for_each_task(const Problem& p, int64_t tasks, const Task& task) {
  run_tasks(p.run_chunks, p.threads, tasks, task);
}

// Softmax in place over each query head's n scores; they are finite (nothing is masked), so fast math is safe.
static void softmax_rows(float* scores, int64_t group, int64_t n) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    float top = sg[0];
    for (int64_t i = 1; i < n; ++i) top = std::max(top, sg[i]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = std::exp(sg[i] - top);
      total += sg[i];
    }
    const float inverse = 1.0f / total;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sg[i] *= inverse;
  }
}

// Any head size, any CPU: scalar loops the compiler vectorizes as it can.
template <typename query_t, typename cache_t>
void decode_attention_generic(const Problem& p, const query_t* q_base, const cache_t* k_base,
                              const cache_t* v_base, query_t* out_base) {
  const int64_t hs = p.head_size;
  for_each_task(p, p.requests * p.kv_heads, [&](int64_t task) {
    const int64_t r = task / p.kv_heads, kvh = task % p.kv_heads;
    const int64_t seq_len = p.lens[r], first = p.first_key(r), n = seq_len - first;
    const int32_t* blocks = p.table + p.table_row_of[r] * p.max_blocks;
    std::vector<float> q(p.group * hs);
    for (int64_t g = 0; g < p.group; ++g) {
      const query_t* qg = q_base + p.row_of[r] * p.q_token_stride + (kvh * p.group + g) * p.q_head_stride;
      for (int64_t d = 0; d < hs; ++d) q[g * hs + d] = static_cast<float>(qg[d]) * p.scale;
    }
    std::vector<float> scores(p.group * n);
    for (int64_t pos = first; pos < seq_len; ++pos) {
      const cache_t* k = k_base + blocks[pos / p.block_size] * p.block_stride
                         + (pos % p.block_size) * p.token_stride + kvh * p.row_size;
      const float k_scale = row_scale(k, hs);
      for (int64_t g = 0; g < p.group; ++g) {
        const float* __restrict qg = q.data() + g * hs;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < hs; ++d) dot += qg[d] * static_cast<float>(k[d]);
        scores[g * n + pos - first] = dot * k_scale;
      }
    }
    softmax_rows(scores.data(), p.group, n);
    std::vector<float> sums(p.group * hs, 0.0f);
    for (int64_t pos = first; pos < seq_len; ++pos) {
      const cache_t* __restrict v = v_base + blocks[pos / p.block_size] * p.block_stride
                                    + (pos % p.block_size) * p.token_stride + kvh * p.row_size;
      const float v_scale = row_scale(v, hs);
      for (int64_t g = 0; g < p.group; ++g) {
        const float weight = scores[g * n + pos - first] * v_scale;
        float* __restrict o = sums.data() + g * hs;
#pragma omp simd
        for (int64_t d = 0; d < hs; ++d) o[d] += weight * static_cast<float>(v[d]);
      }
    }
    query_t* out = out_base + (p.row_of[r] * p.heads + kvh * p.group) * hs;
    for (int64_t i = 0; i < p.group * hs; ++i) out[i] = static_cast<query_t>(sums[i]);
  });
}

#ifdef PATCHBAY_SIMD
#if defined(__AVX512F__)
// One register of int8 cache levels, widened to float (exactly).
static inline vfloat vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The sums of four registers, [sum(a), sum(b), sum(c), sum(d)]: a transposing add tree, cheaper than four sums.
static inline __m128 vsum4(vfloat a, vfloat b, vfloat c, vfloat d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 lanes = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(lanes),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}
#else
static inline vfloat vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

static inline __m128 vsum4(vfloat a, vfloat b, vfloat c, vfloat d) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  const __m256 lanes = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
  return _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
}
#endif

// Four consecutive keys' dot products (vsum4's) times their rows' scales: int8 keys are dotted as levels.
template <typename cache_t>
static inline __m128 scale_dots4(__m128 dots, const cache_t* k, int64_t token_stride, int64_t head_size) {
  if constexpr (kScaledRows<cache_t>) {
    return _mm_mul_ps(dots, _mm_setr_ps(row_scale(k, head_size), row_scale(k + token_stride, head_size),
                                        row_scale(k + 2 * token_stride, head_size),
                                        row_scale(k + 3 * token_stride, head_size)));
  } else {
    return dots;
  }
}

// Prefetches every cache line of `count` rows of `row_bytes` bytes, `stride_bytes` apart.  Lines are counted
// from each row's own start: an int8 row (head_size + 4 bytes) may start anywhere in a line.
template <auto kHint>
static inline void prefetch_rows(const void* first_row, int64_t count, int64_t stride_bytes, int64_t row_bytes) {
  const char* row = static_cast<const char*>(first_row);
  for (int64_t t = 0; t < count; ++t, row += stride_bytes) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(row), end = start + row_bytes;
    for (uintptr_t line = start & ~uintptr_t{63}; line < end; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(line), kHint);
  }
}

// How many query heads the value pass serves at once: their accumulators (heads x kChunks registers) and one
// widened value row must fit in the register file.
constexpr int kRegisters = kLanes == 16 ? 32 : 16;
template <int kChunks>
constexpr int kValueHeads = std::min(8, std::max(1, (kRegisters - kChunks - 2) / kChunks));

// kHeads consecutive query heads of one KV head weigh the value rows [begin, end) into their float32 sums: each
// value row is widened once and feeds kHeads x kChunks independent multiply-adds, so neither a reload per head nor
// one chain of dependent adds per register bounds the pass.  weights: the first head's, one per key from `begin`,
// the next head's `weights_stride` further; sums: the first head's head_size sums, added to.
template <int kChunks, typename cache_t, int kHeads>
static void weigh_values(const Problem& p, const int32_t* blocks, int64_t begin, int64_t end, const cache_t* v_head,
                         const float* weights, int64_t weights_stride, float* sums) {
  vfloat acc[kHeads][kChunks];
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < kChunks; ++c) acc[h][c] = vload(sums + h * p.head_size + c * kLanes);
  for (int64_t pos = begin; pos < end;) {
    const int64_t offset = pos % p.block_size;
    const int64_t count = std::min(p.block_size - offset, end - pos);
    const cache_t* v = v_head + blocks[pos / p.block_size] * p.block_stride + offset * p.token_stride;
    const float* w = weights + pos - begin;
    for (int64_t j = 0; j < count; ++j, v += p.token_stride) {
      vfloat row[kChunks];
      for (int c = 0; c < kChunks; ++c) row[c] = vload(v + c * kLanes);
      // An int8 row's scale goes into its kHeads weights: fewer multiplies than scaling its kChunks registers.
      const float v_scale = row_scale(v, p.head_size);
      for (int h = 0; h < kHeads; ++h) {
        const vfloat weight = vbroadcast(w[h * weights_stride + j] * v_scale);
        for (int c = 0; c < kChunks; ++c) acc[h][c] = vfma(weight, row[c], acc[h][c]);
      }
    }
    pos += count;
  }
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < kChunks; ++c) vstore(sums + h * p.head_size + c * kLanes, acc[h][c]);
}

template <int kChunks, typename cache_t>
using WeighValues = void (*)(const Problem&, const int32_t*, int64_t, int64_t, const cache_t*, const float*, int64_t,
                             float*);
template <int kChunks, typename cache_t>
constexpr WeighValues<kChunks, cache_t> kWeighValues[8] = {
    weigh_values<kChunks, cache_t, 1>, weigh_values<kChunks, cache_t, 2>, weigh_values<kChunks, cache_t, 3>,
    weigh_values<kChunks, cache_t, 4>, weigh_values<kChunks, cache_t, 5>, weigh_values<kChunks, cache_t, 6>,
    weigh_values<kChunks, cache_t, 7>, weigh_values<kChunks, cache_t, 8>};

#if defined(__AVX512BF16__)
// Bfloat16 caches: one query head's scores against `count` keys `token_stride` apart, pairs of bfloat16 features
// multiplied exactly and summed in float32 by AVX512-BF16's pair dot product (half the instructions of widening
// each key to float32 first), then scaled.  kPairRegs registers of 32 features make the head.
template <int kPairRegs>
static inline void bf16_scores(const __m512bh* query, const c10::BFloat16* k, int64_t token_stride,
                               int64_t count, float scale, float* scores) {
  const __m128 scale4 = _mm_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= count; j += 4, k += 4 * token_stride) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int c = 0; c < kPairRegs; ++c) {
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(k + c * 32), query[c]);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(k + token_stride + c * 32), query[c]);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(k + 2 * token_stride + c * 32), query[c]);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(k + 3 * token_stride + c * 32), query[c]);
    }
    _mm_storeu_ps(scores + j, _mm_mul_ps(vsum4(a0, a1, a2, a3), scale4));
  }
  for (; j < count; ++j, k += token_stride) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < kPairRegs; ++c) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + c * 32), query[c]);
    scores[j] = _mm512_reduce_add_ps(acc) * scale;
  }
}
#endif

// Keys a task scores, weighs and folds into its running softmax at a time, per KV head: their rows, read from
// memory for the group's first query head, are still in L1 for the others, and so are their scores when the
// values are weighed.  (Scoring all of a query's keys for each head before weighing any value read them from
// memory once per head at a context of thousands: 4 requests of 8,192 tokens ran at a fifth of the machine's
// read bandwidth.)
constexpr int64_t kKeysPerPass = 128;
// A query with at least twice this many keys, in a step with too few queries to share the threads evenly, has
// its keys split between several tasks whose partial softmaxes are merged at the end.  One request's decode of
// the bundled model at 128 to 430 keys spent ~20 % less in attention split from 256 keys than from 1,024 (Intel
// Xeon with AMX, 2 threads).
constexpr int64_t kMinSegmentKeys = 128;

// One query head's scores against the keys [begin, end) of its KV head (`k_head`: the head's first key row).
template <int kChunks, typename query_t, typename cache_t>
static void score_keys(const Problem& p, const int32_t* blocks, int64_t begin, int64_t end, const cache_t* k_head,
                       const cache_t* v_head, const query_t* query, const float* scaled_query, bool prefetch,
                       float* scores) {
  const int64_t row_bytes = p.row_size * static_cast<int64_t>(sizeof(cache_t));
  const int64_t stride_bytes = p.token_stride * static_cast<int64_t>(sizeof(cache_t));
#if defined(__AVX512BF16__)
  constexpr bool kPairDots = std::is_same<cache_t, c10::BFloat16>::value && std::is_same<query_t, cache_t>::value
                             && kChunks % 2 == 0;
  __m512bh qpairs[kChunks / 2 > 0 ? kChunks / 2 : 1];
  if constexpr (kPairDots)
    for (int c = 0; c < kChunks / 2; ++c) qpairs[c] = (__m512bh)_mm512_loadu_si512(query + c * 32);
#endif
  vfloat qv[kChunks];
  for (int c = 0; c < kChunks; ++c) qv[c] = vload(scaled_query + c * kLanes);
  for (int64_t pos = begin; pos < end;) {
    const int64_t offset = pos % p.block_size;
    const int64_t count = std::min(p.block_size - offset, end - pos);
    const int64_t at = blocks[pos / p.block_size] * p.block_stride + offset * p.token_stride;
    const cache_t* k = k_head + at;
    float* sc = scores + pos - begin;
    if (prefetch) {
      // One block's rows of one head are too few for the hardware prefetcher to start on: ask for the values
      // these keys weigh and the next block's keys while this block's dot products run.
      prefetch_rows<_MM_HINT_T0>(v_head + at, count, stride_bytes, row_bytes);
      const int64_t next = pos + count;
      if (next < end)
        prefetch_rows<_MM_HINT_T0>(k_head + blocks[next / p.block_size] * p.block_stride,
                                   std::min(p.block_size, end - next), stride_bytes, row_bytes);
    }
    pos += count;
#if defined(__AVX512BF16__)
    if constexpr (kPairDots) {
      bf16_scores<kChunks / 2>(qpairs, reinterpret_cast<const c10::BFloat16*>(k), p.token_stride, count, p.scale,
                               sc);
      continue;
    }
#endif
    int64_t j = 0;
    for (; j + 4 <= count; j += 4, k += 4 * p.token_stride) {
      const cache_t* k1 = k + p.token_stride;
      const cache_t* k2 = k1 + p.token_stride;
      const cache_t* k3 = k2 + p.token_stride;
      vfloat a0 = vmul(qv[0], vload(k)), a1 = vmul(qv[0], vload(k1));
      vfloat a2 = vmul(qv[0], vload(k2)), a3 = vmul(qv[0], vload(k3));
      for (int c = 1; c < kChunks; ++c) {
        a0 = vfma(qv[c], vload(k + c * kLanes), a0);
        a1 = vfma(qv[c], vload(k1 + c * kLanes), a1);
        a2 = vfma(qv[c], vload(k2 + c * kLanes), a2);
        a3 = vfma(qv[c], vload(k3 + c * kLanes), a3);
      }
      _mm_storeu_ps(sc + j, scale_dots4(vsum4(a0, a1, a2, a3), k, p.token_stride, p.head_size));
    }
    for (; j < count; ++j, k += p.token_stride) {
      vfloat acc = vmul(qv[0], vload(k));
      for (int c = 1; c < kChunks; ++c) acc = vfma(qv[c], vload(k + c * kLanes), acc);
      sc[j] = vsum(acc) * row_scale(k, p.head_size);
    }
  }
}

// Scores in place as e^(score - top), where `top` is at least their largest; returns their sum.
static float exponentiate(float* scores, int64_t n, float top) {
  const vfloat shift = vbroadcast(-top);
  vfloat sums = vbroadcast(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat e = vexp(vadd(vload(scores + i), shift));
    vstore(scores + i, e);
    sums = vadd(sums, e);
  }
  float total = vsum(sums);
  for (; i < n; ++i) total += (scores[i] = std::exp(scores[i] - top));
  return total;
}

// Which query and which share of its keys each task computes, for every KV head: the keys of a long query are
// split into `segments` consecutive shares where the queries alone are too few tasks for the threads.
struct TaskPlan {
  std::vector<int64_t> first_task;  // per query: its first task; its shares follow
  std::vector<int64_t> segments;    // per query
  int64_t tasks = 0;

  TaskPlan(const Problem& p, int threads) : first_task(p.requests), segments(p.requests) {
    const int64_t queries = std::max<int64_t>(1, p.requests);
    const int64_t wanted = queries >= 4 * threads ? 1 : (4 * threads + queries - 1) / queries;
    for (int64_t r = 0; r < p.requests; ++r) {
      const int64_t keys = p.lens[r] - p.first_key(r);
      segments[r] = std::max<int64_t>(1, std::min(wanted, keys / kMinSegmentKeys));
      first_task[r] = tasks;
      tasks += segments[r];
    }
  }
};

// Head size = kChunks registers.  A task runs over its query's keys kKeysPerPass at a time, for every KV head:
// each query head of the head's group scores the pass's keys (the query's registers stay loaded while the keys
// pass, four keys' dot products reduced once), the scores fold into the query heads' running softmax (the
// largest score so far, the sum of e^(score - largest)), and each value row is weighed for several query heads
// at once.  The first query head asks for each block's values and the next block's keys while it scores, so
// memory sees each key and value once.  A task holding all of a query's keys writes its output; the shares of
// a split query are merged afterwards.
template <int kChunks, typename query_t, typename cache_t>
void decode_attention_simd(const Problem& p, const query_t* q_base, const cache_t* k_base,
                           const cache_t* v_base, query_t* out_base) {
  const int64_t hs = p.head_size, group = p.group;
  const int threads = p.run_chunks != nullptr && p.threads > 1 ? p.threads : omp_get_max_threads();
  const TaskPlan plan(p, threads);
  // Per task and KV head, per query head: the largest score, the sum of exponentials, the weighed values.
  const int64_t partial_floats = group * (hs + 2), task_floats = p.kv_heads * partial_floats;
  std::vector<float> partials;
  if (plan.tasks > p.requests) partials.resize(static_cast<size_t>(plan.tasks * task_floats));
  for_each_task(p, plan.tasks, [&](int64_t task) {
    const int64_t r = std::upper_bound(plan.first_task.begin(), plan.first_task.end(), task)
                      - plan.first_task.begin() - 1;
    const int64_t segments = plan.segments[r], segment = task - plan.first_task[r];
    const int64_t first = p.first_key(r), n = p.lens[r] - first;
    const int64_t begin = first + n * segment / segments, end = first + n * (segment + 1) / segments;
    const int32_t* blocks = p.table + p.table_row_of[r] * p.max_blocks;
    thread_local std::vector<float> scores, queries, own;  // reused by every task a thread runs
    scores.resize(group * kKeysPerPass);
    queries.resize(p.heads * hs);
    if (segments == 1) own.resize(task_floats);
    float* part = segments > 1 ? partials.data() + task * task_floats : own.data();
    const query_t* q_row = q_base + p.row_of[r] * p.q_token_stride;
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t d = 0; d < hs; ++d) queries[h * hs + d] = static_cast<float>(q_row[h * p.q_head_stride + d]) * p.scale;
    for (int64_t kvh = 0; kvh < p.kv_heads; ++kvh) std::fill_n(part + kvh * partial_floats + 2 * group, group * hs, 0.0f);
    for (int64_t pass = begin; pass < end; pass += kKeysPerPass) {
      const int64_t pass_end = std::min(end, pass + kKeysPerPass), count = pass_end - pass;
        for (int64_t kvh = 0; kvh < p.kv_heads; ++kvh) {
        float* top = part + kvh * partial_floats;
        float* total = top + group;
        float* sums = total + group;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = kvh * group + g;
          float* sg = scores.data() + g * kKeysPerPass;
          score_keys<kChunks>(p, blocks, pass, pass_end, k_base + kvh * p.row_size, v_base + kvh * p.row_size,
                              q_row + head * p.q_head_stride, queries.data() + head * hs, g == 0, sg);
          float largest = sg[0];
          for (int64_t j = 1; j < count; ++j) largest = std::max(largest, sg[j]);
          if (pass == begin) {
            top[g] = largest;
            total[g] = exponentiate(sg, count, largest);
            continue;
          }
          // A larger score than any before rescales what the earlier keys added.
          const float new_top = std::max(top[g], largest), rescale = std::exp(top[g] - new_top);
          total[g] = total[g] * rescale + exponentiate(sg, count, new_top);
          top[g] = new_top;
          if (rescale != 1.0f)
            for (int64_t d = 0; d < hs; ++d) sums[g * hs + d] *= rescale;
        }
        for (int64_t g = 0; g < group;) {
          const int64_t heads = std::min<int64_t>(kValueHeads<kChunks>, group - g);
          kWeighValues<kChunks, cache_t>[heads - 1](p, blocks, pass, pass_end, v_base + kvh * p.row_size,
                                                    scores.data() + g * kKeysPerPass, kKeysPerPass, sums + g * hs);
          g += heads;
        }
      }
    }
    if (segments == 1) {
      query_t* out = out_base + p.row_of[r] * p.heads * hs;
      for (int64_t kvh = 0; kvh < p.kv_heads; ++kvh) {
        const float* total = part + kvh * partial_floats + group;
        const float* sums = total + group;
        for (int64_t g = 0; g < group; ++g) {
          const float inverse = 1.0f / total[g];
          for (int64_t d = 0; d < hs; ++d)
            out[(kvh * group + g) * hs + d] = static_cast<query_t>(sums[g * hs + d] * inverse);
        }
      }
    }
  });
  if (partials.empty()) return;
  // Each split query's shares, merged: every share's sums and total rescaled to the largest score of all.
  std::vector<float> sums(hs);
  for (int64_t r = 0; r < p.requests; ++r) {
    const int64_t segments = plan.segments[r];
    if (segments == 1) continue;
    query_t* out = out_base + p.row_of[r] * p.heads * hs;
    for (int64_t kvh = 0; kvh < p.kv_heads; ++kvh) {
      const float* shares = partials.data() + plan.first_task[r] * task_floats + kvh * partial_floats;
      for (int64_t g = 0; g < group; ++g) {
        float top = shares[g];
        for (int64_t s = 1; s < segments; ++s) top = std::max(top, shares[s * task_floats + g]);
        float total = 0.0f;
        std::fill(sums.begin(), sums.end(), 0.0f);
        for (int64_t s = 0; s < segments; ++s) {
          const float* share = shares + s * task_floats;
          const float weight = std::exp(share[g] - top);
          total += share[group + g] * weight;
          for (int64_t d = 0; d < hs; ++d) sums[d] += share[2 * group + g * hs + d] * weight;
        }
        const float inverse = 1.0f / total;
        for (int64_t d = 0; d < hs; ++d) out[(kvh * group + g) * hs + d] = static_cast<query_t>(sums[d] * inverse);
      }
    }
  }
}

template <typename query_t, typename cache_t>
bool decode_attention_fast(const Problem& p, const query_t* q, const cache_t* k, const cache_t* v, query_t* out) {
  if (p.head_size % kLanes != 0) return false;
  switch (p.head_size / kLanes) {
    case 1: decode_attention_simd<1>(p, q, k, v, out); return true;
    case 2: decode_attention_simd<2>(p, q, k, v, out); return true;
    case 3: decode_attention_simd<3>(p, q, k, v, out); return true;
    case 4: decode_attention_simd<4>(p, q, k, v, out); return true;
    case 5: decode_attention_simd<5>(p, q, k, v, out); return true;
    case 6: decode_attention_simd<6>(p, q, k, v, out); return true;
    case 8: decode_attention_simd<8>(p, q, k, v, out); return true;
    case 16: decode_attention_simd<16>(p, q, k, v, out); return true;
    default: return false;
  }
}
#else
template <typename query_t, typename cache_t>
bool decode_attention_fast(const Problem&, const query_t*, const cache_t*, const cache_t*, query_t*) {
  return false;
}
#endif

template <typename query_t, typename cache_t>
void decode_attention(const Problem& p, const torch::Tensor& query, const torch::Tensor& key_cache,
                      const torch::Tensor& value_cache, torch::Tensor& output) {
  const query_t* q = query.data_ptr<query_t>();
  const cache_t* k = key_cache.data_ptr<cache_t>();
  const cache_t* v = value_cache.data_ptr<cache_t>();
  query_t* out = output.data_ptr<query_t>();
  if (!decode_attention_fast(p, q, k, v, out)) decode_attention_generic(p, q, k, v, out);
}

// query: [tokens, heads, head_size] with unit stride along head_size, float32 or bfloat16; output: the same
// shape and dtype, contiguous; key_cache, value_cache: [blocks, block_size, kv_heads, row], contiguous, either
// in the query's dtype (row = head_size) or int8 (row = head_size + 4: levels, then the float32 scale);
// block_table: int32 [requests, max_blocks]; per query: seq_lens int32 (keys it attends, itself included), rows
// int64 (its query row), table_rows int64 (its request's block-table row); window: 0, or the window; chunk_runner:
// a pool's entry point (RunChunks) to run on `threads` threads, or 0 to run over OpenMP.
void paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor rows,
                            torch::Tensor table_rows, double scale, int64_t window, torch::Tensor output,
                            int64_t chunk_runner, int64_t threads) {
  const auto dtype = query.scalar_type(), cache_dtype = key_cache.scalar_type();
  const bool int8_cache = cache_dtype == torch::kInt8;
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && output.scalar_type() == dtype,
              "paged_decode_attention: a float32 or bfloat16 query, and an output of its dtype, expected");
  TORCH_CHECK(value_cache.scalar_type() == cache_dtype && (cache_dtype == dtype || int8_cache),
              "paged_decode_attention: key and value caches both in the query's dtype or both int8 expected");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_decode_attention: a [tokens, heads, head_size] query and two caches of one "
              "[blocks, block_size, kv_heads, row] shape expected");
  const int64_t head_size = query.size(2), row_size = int8_cache ? head_size + kScaleBytes : head_size;
  TORCH_CHECK(key_cache.size(3) == row_size, "paged_decode_attention: ",
              int8_cache ? "int8 cache rows of head_size + 4 bytes (levels, then a float32 scale)"
                         : "cache rows of head_size features",
              " expected: ", row_size, " for head_size ", head_size, ", got ", key_cache.size(3));
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32
              && rows.scalar_type() == torch::kInt64 && table_rows.scalar_type() == torch::kInt64,
              "int32 block table and lengths, int64 rows and table rows expected");
  TORCH_CHECK(seq_lens.numel() == rows.numel() && table_rows.numel() == rows.numel(),
              "one length, one row and one table row per query expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && query.stride(2) == 1
              && output.is_contiguous() && block_table.is_contiguous() && seq_lens.is_contiguous()
              && rows.is_contiguous() && table_rows.is_contiguous(),
              "contiguous caches, block table, per-query arrays and output, and a query with unit stride along "
              "head_size expected");
  const Problem problem(query, key_cache, block_table, seq_lens, rows, table_rows, scale, window, chunk_runner,
                        threads);
  const bool float32 = dtype == torch::kFloat32;
  if (int8_cache && float32) {
    decode_attention<float, int8_t>(problem, query, key_cache, value_cache, output);
  } else if (int8_cache) {
    decode_attention<at::BFloat16, int8_t>(problem, query, key_cache, value_cache, output);
  } else if (float32) {
    decode_attention<float, float>(problem, query, key_cache, value_cache, output);
  } else {
    decode_attention<at::BFloat16, at::BFloat16>(problem, query, key_cache, value_cache, output);
  }
}

// One row of head_size features as an int8 cache row (patchbay.interfaces.int8_kv): scale = max |x| / 127, the
// levels x / scale rounded half to even (nearbyint in the default rounding mode) and clamped, then the scale.
// Fast math may divide by multiplying by 1 / scale, so a level can differ from torch's by one at a tie.
template <typename source_t>
static void quantize_row(const source_t* x, int64_t head_size, int8_t* row) {
  float top = 0.0f;
  for (int64_t d = 0; d < head_size; ++d) top = std::max(top, std::abs(static_cast<float>(x[d])));
  const float scale = top / kLevels;
  for (int64_t d = 0; d < head_size; ++d) {
    const float level = scale > 0.0f ? std::nearbyint(static_cast<float>(x[d]) / scale) : 0.0f;
    row[d] = static_cast<int8_t>(std::clamp(level, -kLevels, kLevels));
  }
  std::memcpy(row + head_size, &scale, sizeof scale);
}

// write_rows' write_row for int8 caches: a row of source_t features quantized into a cache row.
template <typename source_t>
static auto quantizing(int64_t head_size) {
  return [head_size](char* to, const char* from) {
    quantize_row(reinterpret_cast<const source_t*>(from), head_size, reinterpret_cast<int8_t*>(to));
  };
}

// write_row(cache row, key or value row) for each head of each token i, into row slots[i] of the caches.
template <typename WriteRow>
static void write_rows(torch::Tensor& key_cache, torch::Tensor& value_cache, const torch::Tensor& key,
                       const torch::Tensor& value, const torch::Tensor& slots, const WriteRow& write_row) {
  const int64_t heads = key_cache.size(2), rows = key_cache.size(0) * key_cache.size(1), n = slots.numel();
  const int64_t cache_row_bytes = key_cache.size(3) * key_cache.element_size(), element = key.element_size();
  char* k_cache = static_cast<char*>(key_cache.data_ptr());
  char* v_cache = static_cast<char*>(value_cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slots.scalar_type() == torch::kInt32 ? slots.data_ptr<int32_t>()[i] : slots.data_ptr<int64_t>()[i];
    TORCH_CHECK(slot >= 0 && slot < rows, "write_kv: slot ", slot, " of token ", i, " is outside the cache's ", rows,
                " rows");
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = (slot * heads + h) * cache_row_bytes;
      write_row(k_cache + at, k + (i * key.stride(0) + h * key.stride(1)) * element);
      write_row(v_cache + at, v + (i * value.stride(0) + h * value.stride(1)) * element);
    }
  }
}

// The step's new keys and values into the caches, one call per layer instead of a few torch ops per cache.
// key_cache, value_cache: [blocks, block_size, kv_heads, row], contiguous; key, value: [tokens, kv_heads,
// head_size], unit stride along head_size, in the caches' dtype (copied: row = head_size), or float32 or bfloat16
// into int8 caches (each row quantized: row = head_size + 4); slots: int32 or int64, one per token written
// (tokens past them are padding).  Token i goes to row slots[i] of each cache seen as [rows, kv_heads, row].
void write_kv(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor key, torch::Tensor value,
              torch::Tensor slots) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4
              && key_cache.sizes() == value_cache.sizes(), "write_kv: two contiguous caches of one shape expected");
  const auto cache_dtype = key_cache.scalar_type(), dtype = key.scalar_type();
  const bool int8_cache = cache_dtype == torch::kInt8;
  TORCH_CHECK(value_cache.scalar_type() == cache_dtype && value.scalar_type() == dtype
              && (int8_cache ? dtype == torch::kFloat32 || dtype == torch::kBFloat16 : dtype == cache_dtype),
              "write_kv: keys and values in the caches' dtype, or float32 or bfloat16 ones into int8 caches, "
              "expected");
  const int64_t heads = key_cache.size(2), head_size = key_cache.size(3) - (int8_cache ? kScaleBytes : 0);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(1) == heads && value.size(1) == heads
              && key.size(2) == head_size && value.size(2) == head_size && key.stride(2) == 1
              && value.stride(2) == 1 && key.size(0) >= slots.numel() && value.size(0) >= slots.numel(),
              "write_kv: [tokens, kv_heads, head_size] keys and values with unit stride along head_size expected, "
              "head_size ", head_size, int8_cache ? " (the int8 caches' rows less their 4-byte scale)" : "",
              "; got ", key.sizes(), " and ", value.sizes());
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous()
              && (slots.scalar_type() == torch::kInt32 || slots.scalar_type() == torch::kInt64),
              "write_kv: int32 or int64 slots expected");
  if (!int8_cache) {
    const int64_t row_bytes = head_size * key.element_size();
    write_rows(key_cache, value_cache, key, value, slots,
               [row_bytes](char* to, const char* from) { std::memcpy(to, from, row_bytes); });
  } else if (dtype == torch::kFloat32) {
    write_rows(key_cache, value_cache, key, value, slots, quantizing<float>(head_size));
  } else {
    write_rows(key_cache, value_cache, key, value, slots, quantizing<c10::BFloat16>(head_size));
  }
}

// write_kv, then paged_decode_attention into a new output: one call per layer for a step whose every query the
// kernel attends.  kv_cache: [2, blocks, block_size, kv_heads, row], keys then values (the backend's layout);
// slots: one per actual token; output rows past them (padding) are zeros.  Returns None, having written nothing,
// where the tensors are not ones the kernels read (a dtype they do not take, a query or keys without unit
// stride along head_size, a cache of another layout): the caller's general path then takes the layer.
c10::optional<torch::Tensor> write_kv_and_attend(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                                 torch::Tensor kv_cache, torch::Tensor slots,
                                                 torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor rows,
                                                 torch::Tensor table_rows, double scale, int64_t window,
                                                 int64_t chunk_runner, int64_t threads) {
  const auto dtype = query.scalar_type(), cache_dtype = kv_cache.scalar_type();
  const bool kernel_inputs =
      (dtype == torch::kFloat32 || dtype == torch::kBFloat16) && (cache_dtype == dtype || cache_dtype == torch::kInt8)
      && query.dim() == 3 && query.stride(2) == 1 && key.dim() == 3 && value.dim() == 3
      && key.scalar_type() == dtype && value.scalar_type() == dtype && key.stride(2) == 1 && value.stride(2) == 1
      && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() && slots.dim() == 1
      && slots.is_contiguous() && (slots.scalar_type() == torch::kInt32 || slots.scalar_type() == torch::kInt64);
  if (!kernel_inputs) return c10::nullopt;
  torch::Tensor key_cache = kv_cache.select(0, 0), value_cache = kv_cache.select(0, 1);
  write_kv(key_cache, value_cache, key, value, slots);
  auto output = torch::empty(query.sizes(), query.options());
  const int64_t actual = slots.numel();
  if (actual < output.size(0)) output.narrow(0, actual, output.size(0) - actual).zero_();
  paged_decode_attention(query, key_cache, value_cache, block_table, seq_lens, rows, table_rows, scale, window, output,
                         chunk_runner, threads);
  return output;
}

// The kernels run without the GIL: a server's asyncio thread streams while the engine thread is in them
// (docs/design/cpu-fast-paths.md#kernels-and-the-gil).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", torch::wrap_pybind_function_no_gil(paged_decode_attention), "paged_decode_attention");
  m.def("write_kv", torch::wrap_pybind_function_no_gil(write_kv), "write_kv");
  m.def("write_kv_and_attend", torch::wrap_pybind_function_no_gil(write_kv_and_attend), "write_kv_and_attend");
  m.def("amx_prefill_supported", torch::wrap_pybind_function(amx_prefill_supported), "amx_prefill_supported");
  m.def("amx_prefill_attention", torch::wrap_pybind_function_no_gil(amx_prefill_attention), "amx_prefill_attention");
}
