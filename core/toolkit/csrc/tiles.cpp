// Linear products over weights stored in output tiles (patchbay.toolkit.tiles), on the helper
// threads of chunk_pool.h; GGUF block tiles' products are in block_tiles.cpp.
#include <torch/extension.h>
#include "block_tiles.h"
#include "chunk_pool.h"
#include "simd.h"
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

// The pool for other extensions' kernels (the attention's), as a plain C function whose address chunk_runner()
// hands out: the parts of a decode step between its products then share the helpers the products keep awake.
extern "C" void patchbay_run_chunks(int threads, int64_t chunks, void (*work)(const void*, int64_t),
                                    const void* context) {
  ChunkPool::instance().run(threads, chunks, work, context);
}

int64_t chunk_runner() { return reinterpret_cast<int64_t>(&patchbay_run_chunks); }

// The pool's read-ahead, for the tests: products of two chunks that do nothing, on `threads` threads, naming in
// turn the weights [begins[i], begins[i] + bytes[i]) (addresses that need not be mapped: the helpers only
// prefetch them); returns the plan the last one published, as begin and bytes per range, and then the budget.
std::vector<int64_t> chunk_pool_read_ahead(std::vector<int64_t> begins, std::vector<int64_t> bytes, int64_t threads) {
  TORCH_CHECK(begins.size() == bytes.size(), "chunk_pool_read_ahead: one size per weight");
  ChunkPool& pool = ChunkPool::instance();
  for (size_t i = 0; i < begins.size(); ++i)
    pool.run(static_cast<int>(threads), 2, [](int64_t) {},
             WeightRange{reinterpret_cast<const void*>(begins[i]), bytes[i]});
  std::vector<int64_t> flat;
  for (const auto& [begin, size] : pool.published_plan()) flat.insert(flat.end(), {begin, size});
  flat.push_back(pool.warm_budget());
  return flat;
}

// The pool's self-check for the tests: `products` products on `threads` threads, alternately 9 and 2 chunks (a
// larger product right after a smaller one is where a stale claim would land), each chunk counting its own
// runs.  With `throwing_chunk` >= 0 that chunk of every product throws, and the exception must reach the caller.
// Returns how many products, when run() returned, had not run every chunk exactly once or lost the exception.
int64_t chunk_pool_self_check(int64_t threads, int64_t products, int64_t throwing_chunk) {
  constexpr int64_t kLarge = 9, kSmall = 2;
  int64_t wrong = 0;
  for (int64_t product = 0; product < products; ++product) {
    const int64_t chunks = product % 2 == 0 ? kLarge : kSmall;
    std::atomic<int> runs[kLarge];
    for (auto& count : runs) count.store(0, std::memory_order_relaxed);
    bool thrown = false;
    try {
      ChunkPool::instance().run(static_cast<int>(threads), chunks, [&](int64_t chunk) {
        runs[chunk].fetch_add(1, std::memory_order_relaxed);
        if (chunk == throwing_chunk) throw std::runtime_error("chunk_pool_self_check");
      });
    } catch (const std::runtime_error&) {
      thrown = true;
    }
    bool right = thrown == (throwing_chunk >= 0 && throwing_chunk < chunks);
    for (int64_t chunk = 0; chunk < chunks; ++chunk) right = right && runs[chunk].load() == 1;
    wrong += right ? 0 : 1;
  }
  return wrong;
}

#ifdef PATCHBAY_SIMD
// Float32 and int8 weights: tiles of kLanes output features, [K][kLanes] each, widened to float32 in registers.
// int8 weights (weight-only quantization) carry one float32 scale per output feature, float32 ones an optional
// bias.  A block is up to kLaneTiles tiles by up to six rows; activations and output float32 or bfloat16.
constexpr int kLaneTiles = kLanes == 16 ? 4 : 2;

static inline vfloat vload_weights(const float* p) { return vload(p); }
static inline vfloat vload_weights(const int8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
}

// How far ahead of its loads a block of several rows asks for each tile's weights: the panel's first rows
// stream it from memory, four tiles at once, too many streams for the hardware prefetcher to run ahead of.
constexpr int64_t kPrefetchBytes = 2048;

// Store a block's float32 sums to `out` (up to `N` features), times per-feature scales or plus a float32 bias.
template <typename X, int ROWS, int TILES>
static inline void store_block(const vfloat (&acc)[ROWS][TILES], const float* scales, const float* bias, X* out,
                               int64_t ldo, int64_t n0, int64_t N) {
  for (int t = 0; t < TILES; ++t) {
    const int64_t n = n0 + t * kLanes;
    const int64_t valid = std::min<int64_t>(kLanes, N - n);
    alignas(64) float lanes[kLanes];
    for (int m = 0; m < ROWS; ++m) {
      vstore(lanes, scales ? vmul(acc[m][t], vload(scales + n)) : acc[m][t]);
      for (int64_t j = 0; j < valid; ++j) out[m * ldo + n + j] = static_cast<X>(lanes[j] + (bias ? bias[n + j] : 0.0f));
    }
  }
}

template <typename X, typename W, int ROWS, int TILES>
static void lane_block(const X* x, int64_t ldx, const W* tiles, int64_t K, const float* per_feature, X* out,
                       int64_t ldo, int64_t n0, int64_t N) {
  constexpr bool kScaled = std::is_same<W, int8_t>::value;  // per_feature: scales (padded to whole tiles), or bias
  vfloat acc[ROWS][TILES];
  for (int m = 0; m < ROWS; ++m)
    for (int t = 0; t < TILES; ++t) acc[m][t] = vbroadcast(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    vfloat w[TILES];
    for (int t = 0; t < TILES; ++t) w[t] = vload_weights(tiles + (t * K + k) * kLanes);
    if constexpr (ROWS > 1)
      for (int t = 0; t < TILES; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(tiles + (t * K + k + kPrefetchBytes / (kLanes * sizeof(W))) * kLanes),
                     _MM_HINT_T0);
    for (int m = 0; m < ROWS; ++m) {
      const vfloat xb = vbroadcast(static_cast<float>(x[m * ldx + k]));
      for (int t = 0; t < TILES; ++t) acc[m][t] = vfma(w[t], xb, acc[m][t]);
    }
  }
  store_block<X, ROWS, TILES>(acc, kScaled ? per_feature : nullptr, kScaled ? nullptr : per_feature, out, ldo, n0, N);
}

template <int ROWS, int TILES>
static void f32_block(const float* x, int64_t ldx, const float* tiles, int64_t K, const float* bias, float* out,
                      int64_t ldo, int64_t n0, int64_t N) {
  lane_block<float, float, ROWS, TILES>(x, ldx, tiles, K, bias, out, ldo, n0, N);
}

template <int ROWS, int TILES>
static void int8_block_f32(const float* x, int64_t ldx, const int8_t* tiles, int64_t K, const float* scales,
                           float* out, int64_t ldo, int64_t n0, int64_t N) {
  lane_block<float, int8_t, ROWS, TILES>(x, ldx, tiles, K, scales, out, ldo, n0, N);
}

template <int ROWS, int TILES>
static void int8_block_bf16(const c10::BFloat16* x, int64_t ldx, const int8_t* tiles, int64_t K,
                            const float* scales, c10::BFloat16* out, int64_t ldo, int64_t n0, int64_t N) {
  lane_block<c10::BFloat16, int8_t, ROWS, TILES>(x, ldx, tiles, K, scales, out, ldo, n0, N);
}
#endif



#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PATCHBAY_INT4 1
// int4 weights (weight-only quantization on llama.cpp's Q4_1 grid) times activations quantized to int8 per group
// of 32 features, multiplied as bytes: 64 weights per 256-bit load, summed in int32 and scaled once per group.
//
// Tiles are kInt4Lanes output features wide.  For each tile and group of kInt4Group input features, one block of
// kInt4BlockBytes: four steps of 32 bytes, where byte 4i + j of step s holds input feature 8s + j of lane i in its
// low nibble and feature 8s + 4 + j in its high one; then the lanes' float16 scales, then their float16 minimums.
// A weight is level * scale + minimum, so a lane's sum over a group is
//   scale * x_scale * sum(level * x_level) + minimum * sum(x),
// with x = x_level * x_scale (x_scale = max|x| / 127 over the group) and sum(x) taken before rounding.
constexpr int64_t kInt4Lanes = 8;
constexpr int64_t kInt4Group = 32;
constexpr int64_t kInt4BlockBytes = 20 * kInt4Lanes;
// Blocks of up to kInt4Tiles tiles for one row, kInt4RowTiles for several (up to kInt4Rows): each row and tile
// keeps a register of integer sums through the group, and the weights' two nibble registers per tile and the
// activations' two broadcasts must fit beside them in AVX2's sixteen.
constexpr int kInt4Tiles = 4;
constexpr int kInt4RowTiles = 2;
constexpr int kInt4Rows = 4;
// How many groups ahead a block asks for each tile's weights.  A tile's blocks lie one after another, but a tile
// of 576 input features is only 2,880 bytes: four such streams at once end before the hardware prefetcher
// runs ahead of them.  Asking 8 groups ahead (on into the same tile of the next block), one-row products over
// the bundled model's layer shapes read 35-50 % faster from the last-level cache and ~13 % faster from memory
// on an Intel Xeon with AMX; 4 to 32 groups measured alike.
constexpr int64_t kInt4PrefetchGroups = 8;

// Sums of levels (unsigned bytes) times activations (signed bytes) over one group.  With VNNI each lane's four
// byte products add straight into its int32; without, pairs of products add into int16s (each at most
// 2 * 15 * 127 = 3810, so a group's eight stay below 32767) and the pairs into the lane's int32 once per group.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i dot_bytes(__m256i sums, __m256i levels, __m256i activations) {
  return _mm256_dpbusd_epi32(sums, levels, activations);
}
static inline __m256i group_sums(__m256i sums) { return sums; }
#else
static inline __m256i dot_bytes(__m256i sums, __m256i levels, __m256i activations) {
  return _mm256_add_epi16(sums, _mm256_maddubs_epi16(levels, activations));
}
static inline __m256i group_sums(__m256i sums) { return _mm256_madd_epi16(sums, _mm256_set1_epi16(1)); }
#endif

// A product's activations as int8 per group: levels [rows][K], and per row and group the scale and the exact sum.
struct Int8Rows {
  const int8_t* levels;
  const float* scales;
  const float* sums;
  int64_t K;
  int64_t groups;
};

// Row m's groups as int8 levels (x * 127 / max|x|, rounded to nearest even), with each group's scale and sum.
template <typename X>
static void quantize_row(const X* x, int64_t K, int8_t* levels, float* scales, float* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < K / kInt4Group; ++g) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(x + g * kInt4Group + 8 * i);
    const __m256 largest8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                          _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
    __m128 largest4 = _mm_max_ps(_mm256_castps256_ps128(largest8), _mm256_extractf128_ps(largest8, 1));
    largest4 = _mm_max_ps(largest4, _mm_movehl_ps(largest4, largest4));
    const float largest = _mm_cvtss_f32(_mm_max_ss(largest4, _mm_shuffle_ps(largest4, largest4, 1)));
    const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    __m256i rounded[4];
    for (int i = 0; i < 4; ++i) rounded[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // nearest even
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(rounded[0], rounded[1]),
                                             _mm256_packs_epi32(rounded[2], rounded[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(levels + g * kInt4Group),
                        _mm256_permutevar8x32_epi32(bytes, order));
    const __m256 total = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
    __m128 total4 = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    total4 = _mm_add_ps(total4, _mm_movehl_ps(total4, total4));
    scales[g] = largest / 127.0f;
    sums[g] = _mm_cvtss_f32(_mm_add_ss(total4, _mm_shuffle_ps(total4, total4, 1)));
  }
}

// Every row of x quantized (quantize_row), rows shared over the pool's threads when there are many.
template <typename X>
static void quantize_rows(const X* x, int64_t ldx, int64_t rows, int64_t K, int8_t* levels, float* scales,
                          float* sums, int64_t threads) {
  const int64_t groups = K / kInt4Group;
  constexpr int64_t kRowsPerChunk = 8;
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  ChunkPool::instance().run(rows >= 2 * kRowsPerChunk ? static_cast<int>(threads) : 1, chunks, [&](int64_t chunk) {
    for (int64_t m = chunk * kRowsPerChunk; m < std::min(rows, (chunk + 1) * kRowsPerChunk); ++m)
      quantize_row(x + m * ldx, K, levels + m * K, scales + m * groups, sums + m * groups);
  });
}

template <typename X, int ROWS, int TILES>
static void int4_block(const Int8Rows& x, int64_t m0, const uint8_t* panel, const float* bias, X* out, int64_t ldo,
                       int64_t n0, int64_t N) {
  const int64_t groups = x.groups;
  __m256 acc[ROWS][TILES];
  for (int m = 0; m < ROWS; ++m)
    for (int t = 0; t < TILES; ++t) acc[m][t] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block[TILES];
    for (int t = 0; t < TILES; ++t) block[t] = panel + (t * groups + g) * kInt4BlockBytes;
    const int64_t ahead = g + kInt4PrefetchGroups;
    for (int t = 0; t < TILES; ++t) {
      const int64_t at = ahead < groups ? t * groups + ahead : (t + TILES) * groups + ahead - groups;
      for (int64_t line = 0; line < kInt4BlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(panel + at * kInt4BlockBytes + line), _MM_HINT_T0);
    }
    __m256i dots[ROWS][TILES];
    for (int m = 0; m < ROWS; ++m)
      for (int t = 0; t < TILES; ++t) dots[m][t] = _mm256_setzero_si256();
    for (int step = 0; step < 4; ++step) {
      __m256i low[TILES], high[TILES];
      for (int t = 0; t < TILES; ++t) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[t] + step * 32));
        low[t] = _mm256_and_si256(bytes, nibble);
        high[t] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      }
      for (int m = 0; m < ROWS; ++m) {
        const int8_t* levels = x.levels + (m0 + m) * x.K + g * kInt4Group + step * 8;
        int32_t first, second;
        std::memcpy(&first, levels, 4);
        std::memcpy(&second, levels + 4, 4);
        const __m256i a = _mm256_set1_epi32(first), b = _mm256_set1_epi32(second);
        for (int t = 0; t < TILES; ++t) dots[m][t] = dot_bytes(dot_bytes(dots[m][t], low[t], a), high[t], b);
      }
    }
    for (int t = 0; t < TILES; ++t) {
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block[t] + 128)));
      const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block[t] + 144)));
      for (int m = 0; m < ROWS; ++m) {
        const int64_t at = (m0 + m) * groups + g;
        const __m256 scaled = _mm256_mul_ps(scale, _mm256_set1_ps(x.scales[at]));
        acc[m][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_sums(dots[m][t])), scaled, acc[m][t]);
        acc[m][t] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(x.sums[at]), acc[m][t]);
      }
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const int64_t n = n0 + t * kInt4Lanes;
    const int64_t valid = std::min<int64_t>(kInt4Lanes, N - n);
    alignas(32) float lanes[kInt4Lanes];
    for (int m = 0; m < ROWS; ++m) {
      _mm256_store_ps(lanes, acc[m][t]);
      for (int64_t j = 0; j < valid; ++j)
        out[(m0 + m) * ldo + n + j] = static_cast<X>(lanes[j] + (bias ? bias[n + j] : 0.0f));
    }
  }
}

template <typename X>
using Int4Block = void (*)(const Int8Rows&, int64_t, const uint8_t*, const float*, X*, int64_t, int64_t, int64_t);

template <typename X, int TILES>
struct Int4Blocks {
  static constexpr Int4Block<X> rows[kInt4Rows] = {int4_block<X, 1, TILES>, int4_block<X, 2, TILES>,
                                                   int4_block<X, 3, TILES>, int4_block<X, 4, TILES>};
};

// Every row times the tiles [tile_begin, tile_end): blocks of up to kInt4Tiles tiles by up to kInt4Rows rows.
template <typename X>
static void int4_tile_range(const Int8Rows& x, int64_t rows, const uint8_t* tiles, const float* bias, X* out,
                            int64_t N, int64_t tile_begin, int64_t tile_end) {
  static const Int4Block<X>* by_tiles[kInt4Tiles] = {Int4Blocks<X, 1>::rows, Int4Blocks<X, 2>::rows,
                                                     Int4Blocks<X, 3>::rows, Int4Blocks<X, 4>::rows};
  const int64_t tile_bytes = x.groups * kInt4BlockBytes;
  const int64_t block_tiles = rows > 1 ? kInt4RowTiles : kInt4Tiles;
  for (int64_t t0 = tile_begin; t0 < tile_end; t0 += block_tiles) {
    const int64_t tiles_here = std::min<int64_t>(block_tiles, tile_end - t0);
    for (int64_t m0 = 0; m0 < rows; m0 += kInt4Rows) {
      const int64_t rows_here = std::min<int64_t>(kInt4Rows, rows - m0);
      by_tiles[tiles_here - 1][rows_here - 1](x, m0, tiles + t0 * tile_bytes, bias, out, N, t0 * kInt4Lanes, N);
    }
  }
}
#endif

#if defined(__AMX_TILE__)
#define PATCHBAY_AMX_TILE 1
#include "amx.h"

// Which tile product a kernel runs: bfloat16 pairs into float32 sums, or unsigned by signed bytes into int32 sums.
enum class AmxProduct { kBfloat16Pairs, kBytes };

// The tile product P of tile registers A and B into SUMS (the intrinsics name their registers in the instruction's
// text, so they take literal numbers: a macro, not a template).
#if defined(__AMX_INT8__)
#define PATCHBAY_AMX_BYTES(SUMS, A, B) _tile_dpbusd(SUMS, A, B)
#else
#define PATCHBAY_AMX_BYTES(SUMS, A, B) ((void)0)
#endif
#if defined(__AMX_BF16__)
#define PATCHBAY_AMX_PAIRS(SUMS, A, B) _tile_dpbf16ps(SUMS, A, B)
#else
#define PATCHBAY_AMX_PAIRS(SUMS, A, B) ((void)0)
#endif
#define PATCHBAY_AMX_PRODUCT(P, SUMS, A, B)                                              \
  do {                                                                                   \
    if constexpr (P == AmxProduct::kBytes) PATCHBAY_AMX_BYTES(SUMS, A, B);               \
    else PATCHBAY_AMX_PAIRS(SUMS, A, B);                                                 \
  } while (0)

// Sums of 16 * ROW_SLICES rows of A (the slices at `x` and `x_next`, rows `x_stride` bytes apart) by TILES weight
// tiles (the first at `panel`, the next `tile_bytes` on) over `steps` operands: 64 bytes of each row of A, and the
// next 1 KiB (16 lines of 64 bytes) of each tile.  The 4-byte sums are 16 x 16 blocks in `sums`, rows
// `sums_stride` bytes apart, the second tile's 64 bytes right of the first's and the second slice's 16 rows below;
// they start from what `sums` holds when `resume`, else from zero.  Tile registers: 0-3 the sums (2 x 2), 4-5 the
// slices of A, 6-7 the tiles' lines.
template <AmxProduct P, int ROW_SLICES, int TILES>
static void amx_pass(const char* x, const char* x_next, int64_t x_stride, const char* panel, int64_t tile_bytes,
                     int64_t steps, char* sums, int64_t sums_stride, bool resume) {
  char* lower = sums + kAmxRows * sums_stride;
  if (resume) {
    _tile_loadd(0, sums, sums_stride);
    if constexpr (TILES > 1) _tile_loadd(1, sums + 64, sums_stride);
    if constexpr (ROW_SLICES > 1) _tile_loadd(2, lower, sums_stride);
    if constexpr (ROW_SLICES > 1 && TILES > 1) _tile_loadd(3, lower + 64, sums_stride);
  } else {
    _tile_zero(0);
    if constexpr (TILES > 1) _tile_zero(1);
    if constexpr (ROW_SLICES > 1) _tile_zero(2);
    if constexpr (ROW_SLICES > 1 && TILES > 1) _tile_zero(3);
  }
  for (int64_t step = 0; step < steps; ++step) {
    _tile_loadd(4, x + 64 * step, x_stride);
    _tile_loadd(6, panel + 1024 * step, 64);
    PATCHBAY_AMX_PRODUCT(P, 0, 4, 6);
    if constexpr (TILES > 1) {
      _tile_loadd(7, panel + tile_bytes + 1024 * step, 64);
      PATCHBAY_AMX_PRODUCT(P, 1, 4, 7);
    }
    if constexpr (ROW_SLICES > 1) {
      _tile_loadd(5, x_next + 64 * step, x_stride);
      PATCHBAY_AMX_PRODUCT(P, 2, 5, 6);
      if constexpr (TILES > 1) PATCHBAY_AMX_PRODUCT(P, 3, 5, 7);
    }
  }
  _tile_stored(0, sums, sums_stride);
  if constexpr (TILES > 1) _tile_stored(1, sums + 64, sums_stride);
  if constexpr (ROW_SLICES > 1) _tile_stored(2, lower, sums_stride);
  if constexpr (ROW_SLICES > 1 && TILES > 1) _tile_stored(3, lower + 64, sums_stride);
}

// amx_pass of one or two row slices by one or two tiles, as the block's edges leave.
template <AmxProduct P>
static void amx_pass_of(bool two_tiles, const char* x, const char* x_next, int64_t x_stride, const char* panel,
                        int64_t tile_bytes, int64_t steps, char* sums, int64_t sums_stride, bool resume) {
  if (x_next && two_tiles) amx_pass<P, 2, 2>(x, x_next, x_stride, panel, tile_bytes, steps, sums, sums_stride, resume);
  else if (x_next) amx_pass<P, 2, 1>(x, x_next, x_stride, panel, tile_bytes, steps, sums, sums_stride, resume);
  else if (two_tiles) amx_pass<P, 1, 2>(x, x, x_stride, panel, tile_bytes, steps, sums, sums_stride, resume);
  else amx_pass<P, 1, 1>(x, x, x_stride, panel, tile_bytes, steps, sums, sums_stride, resume);
}

// How a tile product of many rows is cut so that each operand is read from the nearest cache that holds it.  A
// pass over up to kAmxDepthSteps operands (the depth cut evenly) reads 8 KiB of each tile: a pair of tiles
// (16 KiB) stays in L1 while every 32-row block of the rows passes over it with its own 16 KiB, and those rows'
// 64-byte columns (128 KiB at most) stay in L2 while the group's tile pairs pass.  A thread's range of tiles
// that fits in kAmxRangeInL2 stays in L2 whole, and up to 32 rows reuse no tile: there every 32 rows pass over the
// whole range in turn, each block summed over the whole depth (on the bundled model's layer, 10 % faster at 64
// and 128 rows than the groups and blocks).  The sums of kAmxBlockRows rows by kAmxGroupTiles tiles wait between passes in a buffer of this
// thread's.  On an Intel Xeon with AMX (2 threads), the four products of a decoder layer of
// Llama-3.2-1B's shape at 256 rows took 18-23 ms cut so, 27.5 ms with each 32 rows passing over every tile in
// turn; passes of 16 operands measured 5-8 % slower, and asking for the next pass's operands ahead no faster.
constexpr int64_t kAmxBlockRows = 256;
constexpr int64_t kAmxGroupTiles = 16;
constexpr int64_t kAmxDepthSteps = 8;
constexpr int64_t kAmxRangeInL2 = 512 << 10;
// Bytes between the buffer's rows: one line more than its tiles' 64 each, so that a tile's 16 rows do not
// fall into the same L1 sets.
constexpr int64_t kAmxSumsStride = kAmxGroupTiles * 64 + 64;

// The rows of A in 16-row slices: `full` slices in place at `x`, rows `x_stride` bytes apart, and after them the
// `tail` slice, if any (the last rows and zeros after them, rows as far apart).
struct AmxRows {
  const char* x;
  int64_t x_stride;
  int64_t full;
  const char* tail;
  int64_t padded_rows() const { return (full + (tail ? 1 : 0)) * kAmxRows; }
  const char* slice(int64_t m0) const { return m0 / kAmxRows < full ? x + m0 * x_stride : tail; }
};

// Every row of A (`rows.padded_rows()`) times the tiles [tile_begin, tile_end) over `steps` operands.
// Once a block of rows by a group of tiles is summed, `finish(m0, block_rows, t0, group_tiles, sums, stride)`
// takes its 4-byte sums: row m0 + r, tile t0 + t at sums + r * stride + t * 64.
template <AmxProduct P, typename Finish>
static void amx_range(const AmxRows& rows, const char* tiles, int64_t tile_bytes, int64_t steps, int64_t tile_begin,
                      int64_t tile_end, const Finish& finish) {
  thread_local std::vector<char> buffer;
  buffer.resize(static_cast<size_t>(kAmxBlockRows * kAmxSumsStride + 64));
  char* sums = buffer.data() + (-reinterpret_cast<intptr_t>(buffer.data()) & 63);  // 64-byte aligned
  configure_amx_tiles();
  const int64_t padded_rows = rows.padded_rows();
  if (padded_rows <= 2 * kAmxRows || (tile_end - tile_begin) * tile_bytes <= kAmxRangeInL2) {
    // Every 32 rows pass over the whole range, each 32 x 32 block summed over the whole depth and finished at once
    // (its sums' rows 128 bytes apart: 4 KiB in all).
    constexpr int64_t kBlockStride = 2 * 64;
    for (int64_t m0 = 0; m0 < padded_rows; m0 += 2 * kAmxRows) {
      const bool two_slices = m0 + kAmxRows < padded_rows;
      for (int64_t t0 = tile_begin; t0 < tile_end; t0 += 2) {
        amx_pass_of<P>(t0 + 1 < tile_end, rows.slice(m0), two_slices ? rows.slice(m0 + kAmxRows) : nullptr,
                       rows.x_stride, tiles + t0 * tile_bytes, tile_bytes, steps, sums, kBlockStride, false);
        finish(m0, two_slices ? 2 * kAmxRows : kAmxRows, t0, std::min<int64_t>(2, tile_end - t0),
               static_cast<const char*>(sums), kBlockStride);
      }
    }
    _tile_release();
    return;
  }
  for (int64_t group = tile_begin; group < tile_end; group += kAmxGroupTiles) {
    const int64_t group_end = std::min(tile_end, group + kAmxGroupTiles);
    for (int64_t block = 0; block < padded_rows; block += kAmxBlockRows) {
      const int64_t block_end = std::min(padded_rows, block + kAmxBlockRows);
      const int64_t passes = (steps + kAmxDepthSteps - 1) / kAmxDepthSteps;
      const int64_t depth = (steps + passes - 1) / passes;  // as even as the steps allow
      for (int64_t s0 = 0; s0 < steps; s0 += depth) {
        const int64_t pass_steps = std::min(depth, steps - s0);
        for (int64_t t0 = group; t0 < group_end; t0 += 2) {
          const char* panel = tiles + t0 * tile_bytes + s0 * 1024;
          for (int64_t m0 = block; m0 < block_end; m0 += 2 * kAmxRows)
            amx_pass_of<P>(t0 + 1 < group_end, rows.slice(m0) + s0 * 64,
                           m0 + kAmxRows < block_end ? rows.slice(m0 + kAmxRows) + s0 * 64 : nullptr, rows.x_stride,
                           panel, tile_bytes, pass_steps, sums + (m0 - block) * kAmxSumsStride + (t0 - group) * 64,
                           kAmxSumsStride, s0 > 0);
        }
      }
      finish(block, block_end - block, group, group_end - group, static_cast<const char*>(sums), kAmxSumsStride);
    }
  }
  _tile_release();
}
#endif

// Which kernel multiplies bfloat16 tiles: the pair dot product (false) or float32 multiply-adds (true); and up to
// how many rows the pair dot product runs all the same (a row or two stream weights faster through it).
static std::atomic<bool> bf16_through_fma{false};
static std::atomic<int64_t> bf16_pairs_max_rows{0};
// Products of at least this many rows run through AMX where the CPU has it (0: never).
static std::atomic<int64_t> bf16_amx_from_rows{0};

#if defined(__AVX512BF16__)
static inline void vstore_masked_bf16(c10::BFloat16* p, __m512 a, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(a));  // rounded to nearest even
}

// Bfloat16 weights: tiles of 16 output features, [K/2][16][2] each (pairs of input features per lane).
constexpr int kBf16Tiles = 4;
constexpr int kBf16Rows = 6;

// A block's float32 sums to bfloat16 `out` (up to `N` features), plus a bfloat16 bias.
template <int ROWS, int TILES>
static inline void store_bf16_block(const __m512 (&acc)[ROWS][TILES], const c10::BFloat16* bias, c10::BFloat16* out,
                                    int64_t ldo, int64_t n0, int64_t N) {
  for (int t = 0; t < TILES; ++t) {
    const int64_t n = n0 + t * 16;
    const __mmask16 mask = vmask_first(N - n);
    __m512 b = _mm512_setzero_ps();
    if (bias) b = vload_masked(bias + n, mask);
    for (int m = 0; m < ROWS; ++m) vstore_masked_bf16(out + m * ldo + n, _mm512_add_ps(acc[m][t], b), mask);
  }
}

template <int ROWS, int TILES>
static void bf16_block(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* tiles, int64_t pairs,
                       const c10::BFloat16* bias, c10::BFloat16* out, int64_t ldo, int64_t n0, int64_t N) {
  __m512 acc[ROWS][TILES];
  for (int m = 0; m < ROWS; ++m)
    for (int t = 0; t < TILES; ++t) acc[m][t] = _mm512_setzero_ps();
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(x);
  const int64_t ldx_pairs = ldx / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[TILES];
    for (int t = 0; t < TILES; ++t)
      w[t] = (__m512bh)_mm512_loadu_si512(tiles + (t * pairs + p) * 32);
    // Ask ahead for each tile's stream, at every row count: a one-row decode product read 12 % faster from
    // memory (Intel Xeon with AMX), and a panel's first rows of a larger product stream it too.
    for (int t = 0; t < TILES; ++t)
      _mm_prefetch(reinterpret_cast<const char*>(tiles + (t * pairs + p + kPrefetchBytes / 64) * 32), _MM_HINT_T0);
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xpairs[m * ldx_pairs + p]);
      for (int t = 0; t < TILES; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], w[t], xb);
    }
  }
  store_bf16_block<ROWS, TILES>(acc, bias, out, ldo, n0, N);
}

// The same tiles through float32 multiply-adds, for CPUs that issue vdpbf16ps at a fraction of their FMA rate
// (an Intel Xeon without AMX: 40 G pair products per core against 85 G FMAs).  A bfloat16 is the top half of a
// float32, so each line of pairs widens in two instructions: feature 2p shifted up, feature 2p + 1 masked.  The
// activations come widened to float32 (`x`), once per product.  Products are exact and summed in float32, one
// multiply-add at a time (the pair kernel adds two per instruction, so the two round apart).  Six rows by three
// tiles of sums, six widened weight registers and two broadcasts fit AVX-512's 32 registers.
constexpr int kBf16FmaTiles = 3;

template <int ROWS, int TILES>
static void bf16_fma_block(const float* x, int64_t ldx, const c10::BFloat16* tiles, int64_t pairs,
                           const c10::BFloat16* bias, c10::BFloat16* out, int64_t ldo, int64_t n0, int64_t N) {
  __m512 acc[ROWS][TILES];
  for (int m = 0; m < ROWS; ++m)
    for (int t = 0; t < TILES; ++t) acc[m][t] = _mm512_setzero_ps();
  const __m512i upper_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    __m512 first[TILES], second[TILES];
    for (int t = 0; t < TILES; ++t) {
      const __m512i line = _mm512_loadu_si512(tiles + (t * pairs + p) * 32);
      first[t] = _mm512_castsi512_ps(_mm512_slli_epi32(line, 16));
      second[t] = _mm512_castsi512_ps(_mm512_and_si512(line, upper_half));
    }
    for (int t = 0; t < TILES; ++t)  // as bf16_block
      _mm_prefetch(reinterpret_cast<const char*>(tiles + (t * pairs + p + kPrefetchBytes / 64) * 32), _MM_HINT_T0);
    for (int m = 0; m < ROWS; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * ldx + 2 * p]), b = _mm512_set1_ps(x[m * ldx + 2 * p + 1]);
      for (int t = 0; t < TILES; ++t) acc[m][t] = _mm512_fmadd_ps(second[t], b, _mm512_fmadd_ps(first[t], a, acc[m][t]));
    }
  }
  store_bf16_block<ROWS, TILES>(acc, bias, out, ldo, n0, N);
}

// Rows of bfloat16 x as float32, into a buffer of this thread's that keeps its memory for the next product.
static const float* widen_rows(const c10::BFloat16* x, int64_t ldx, int64_t rows, int64_t K) {
  thread_local std::vector<float> widened;
  widened.resize(static_cast<size_t>(rows * K));
  for (int64_t m = 0; m < rows; ++m) {
    const c10::BFloat16* row = x + m * ldx;
    float* to = widened.data() + m * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
      _mm512_storeu_ps(to + k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
    }
    for (; k < K; ++k) to[k] = static_cast<float>(row[k]);
  }
  return widened.data();
}

#if defined(PATCHBAY_AMX_TILE) && defined(__AMX_BF16__)
#define PATCHBAY_AMX_BF16 1
// Bfloat16 tiles through AMX, for products of many rows (prefill chunks, large decode batches), where the pair
// dot product is bound by arithmetic and AMX's tile product does 16 times its work per instruction.  A tile of
// 16 output features is [K/2][16][2]: 16 lines of it (32 input features) are exactly AMX's B operand, 16 pairs
// by 16 features, 64 bytes a line; 16 rows of x by 32 input features are its A operand, read in place (see
// amx_pass).  A last slice of fewer than 16 rows is read from a copy of them padded with zero rows.
constexpr int64_t kAmxPairs = 16;  // pairs of input features in one B operand
// Every row of x (`a`, of which the first `rows` are real) times tiles [tile_begin, tile_end), cut as amx_range
// cuts it.
static void bf16_amx_range(const AmxRows& a, int64_t rows, const c10::BFloat16* tiles, int64_t pairs,
                           const c10::BFloat16* bias, c10::BFloat16* out, int64_t ldo, int64_t N, int64_t tile_begin,
                           int64_t tile_end) {
  const auto finish = [&](int64_t m0, int64_t block_rows, int64_t t0, int64_t group_tiles, const char* sums,
                          int64_t stride) {
    for (int64_t t = 0; t < group_tiles; ++t) {
      const int64_t n = (t0 + t) * 16;
      const __mmask16 mask = vmask_first(N - n);
      const __m512 b = bias ? vload_masked(bias + n, mask) : _mm512_setzero_ps();
      for (int64_t r = 0; r < block_rows && m0 + r < rows; ++r) {
        const float* line = reinterpret_cast<const float*>(sums + r * stride + t * 64);
        vstore_masked_bf16(out + (m0 + r) * ldo + n, _mm512_add_ps(_mm512_load_ps(line), b), mask);
      }
    }
  };
  amx_range<AmxProduct::kBfloat16Pairs>(a, reinterpret_cast<const char*>(tiles), pairs * 64, pairs / kAmxPairs,
                                        tile_begin, tile_end, finish);
}
#endif

#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PATCHBAY_W8A8 1
// W8A8: int8 weights with one float32 scale per output feature, times activations rounded to int8 with one scale
// per row, multiplied as bytes by VNNI's four-way dot product (64 products per instruction, twice bfloat16's pair
// dot product) and summed exactly in int32; each sum is scaled once, at the end.
//
// A tile holds kW8A8Lanes output features over K input features as K/4 + 2 lines of 64 bytes: line q holds input
// features 4q..4q+3 of every lane (byte 4i + j: feature 4q + j of lane i); then the lanes' float32 scales; then
// the lanes' int32 offsets, 128 times the sum of their weights.  Activations enter the dot product as unsigned
// bytes, level + 128, so each sum carries 128 times its weights' sum, which the offset takes back out:
//   out[m][n] = (sum_k (a[m][k] + 128) * w[n][k] - offset[n]) * (x_scale[m] * w_scale[n]) + bias[n],
// with a = round(x * (127 / max|x_row|)) (nearest even) and x_scale = max|x_row| / 127; the last multiply and
// the bias's add are one fused multiply-add, rounded once.
constexpr int64_t kW8A8Lanes = 16;
constexpr int64_t kW8A8LineBytes = 64;
constexpr int kW8A8Tiles = 4;
constexpr int kW8A8Rows = 6;

// Row x (K features) as unsigned levels a + 128 in `levels`; returns the row's scale, max|x| / 127.
template <typename X>
static float quantize_row_w8a8(const X* x, int64_t K, uint8_t* levels) {
  __m512 largest = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16)
    largest = _mm512_max_ps(largest, _mm512_abs_ps(vload_masked(x + k, vmask_first(K - k))));
  const float top = _mm512_reduce_max_ps(largest);
  const __m512 inverse = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = vmask_first(K - k);
    const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(vload_masked(x + k, mask), inverse));  // nearest even
    _mm_mask_storeu_epi8(levels + k, mask, _mm512_cvtepi32_epi8(_mm512_add_epi32(rounded, offset)));
  }
  return top / 127.0f;
}

// acc + the four-way byte dot products of `levels` (unsigned) and `weights` (signed), as _mm512_dpbusd_epi32.
// Written as one instruction because GCC 12 compiles the intrinsic in a block of accumulators into register copies
// and a store of every accumulator on each line: 6 x 4 blocks ran at 147 G multiply-adds per second on one core of
// an Intel Xeon (family 6 model 207), this form at 334 G, the instruction's own ceiling there.
static inline __m512i add_byte_dots(__m512i acc, __m512i levels, __m512i weights) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(levels), "v"(weights));
  return acc;
}

template <typename X, int ROWS, int TILES>
static void w8a8_block(const uint8_t* x, int64_t ldx, const float* x_scales, const int8_t* panel, int64_t lines,
                       const float* bias, X* out, int64_t ldo, int64_t n0, int64_t N) {
  const int64_t tile_bytes = (lines + 2) * kW8A8LineBytes;
  __m512i acc[ROWS][TILES];
  for (int m = 0; m < ROWS; ++m)
    for (int t = 0; t < TILES; ++t) acc[m][t] = _mm512_setzero_si512();
  for (int64_t q = 0; q < lines; ++q) {
    __m512i w[TILES];
    for (int t = 0; t < TILES; ++t) w[t] = _mm512_loadu_si512(panel + t * tile_bytes + q * kW8A8LineBytes);
    if constexpr (ROWS > 1)  // as bf16_block: the panel's first rows stream it from memory
      for (int t = 0; t < TILES; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(panel + t * tile_bytes + q * kW8A8LineBytes + kPrefetchBytes),
                     _MM_HINT_T0);
    for (int m = 0; m < ROWS; ++m) {
      int32_t quad;
      std::memcpy(&quad, x + m * ldx + 4 * q, 4);
      const __m512i xb = _mm512_set1_epi32(quad);
      for (int t = 0; t < TILES; ++t) acc[m][t] = add_byte_dots(acc[m][t], xb, w[t]);
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const int8_t* tail = panel + t * tile_bytes + lines * kW8A8LineBytes;
    const __m512 w_scales = _mm512_loadu_ps(tail);
    const __m512i offsets = _mm512_loadu_si512(tail + kW8A8LineBytes);
    const int64_t n = n0 + t * kW8A8Lanes;
    const __mmask16 mask = vmask_first(N - n);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < ROWS; ++m) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][t], offsets));
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(x_scales[m]), w_scales);
      vstore_masked(out + m * ldo + n, _mm512_fmadd_ps(sums, scale, b), mask);
    }
  }
}

template <typename X>
using W8A8Block = void (*)(const uint8_t*, int64_t, const float*, const int8_t*, int64_t, const float*, X*, int64_t,
                           int64_t, int64_t);
#define PATCHBAY_W8A8_ROWS(X, T) \
  {w8a8_block<X, 1, T>, w8a8_block<X, 2, T>, w8a8_block<X, 3, T>, w8a8_block<X, 4, T>, w8a8_block<X, 5, T>, \
   w8a8_block<X, 6, T>}

// Every row times the tiles [tile_begin, tile_end), blocks of up to kW8A8Rows rows by up to kW8A8Tiles tiles.
template <typename X>
static void w8a8_tile_range(const uint8_t* x, int64_t K, const float* x_scales, int64_t rows, const int8_t* tiles,
                            const float* bias, X* out, int64_t N, int64_t tile_begin, int64_t tile_end) {
  static const W8A8Block<X> blocks[kW8A8Tiles][kW8A8Rows] = {PATCHBAY_W8A8_ROWS(X, 1), PATCHBAY_W8A8_ROWS(X, 2),
                                                             PATCHBAY_W8A8_ROWS(X, 3), PATCHBAY_W8A8_ROWS(X, 4)};
  const int64_t lines = K / 4, tile_bytes = (lines + 2) * kW8A8LineBytes;
  for (int64_t t0 = tile_begin; t0 < tile_end; t0 += kW8A8Tiles) {
    const int64_t tiles_here = std::min<int64_t>(kW8A8Tiles, tile_end - t0);
    for (int64_t m0 = 0; m0 < rows; m0 += kW8A8Rows) {
      const int64_t rows_here = std::min<int64_t>(kW8A8Rows, rows - m0);
      blocks[tiles_here - 1][rows_here - 1](x + m0 * K, K, x_scales + m0, tiles + t0 * tile_bytes, lines, bias,
                                            out + m0 * N, N, t0 * kW8A8Lanes, N);
    }
  }
}
#undef PATCHBAY_W8A8_ROWS

#if defined(PATCHBAY_AMX_TILE) && defined(__AMX_INT8__)
#define PATCHBAY_AMX_W8A8 1
// W8A8 tiles through AMX's byte product (unsigned levels by signed weights, as VNNI's), for products of many rows:
// 16 lines of a tile (64 input features) are AMX's B operand as they lie, 16 rows of levels its A operand.  The
// int32 sums are VNNI's exactly, and the same epilogue scales them, so the outputs equal the kernel's above.
constexpr int64_t kAmxW8A8Lines = 16;

// Every row of levels (`a`: rows of K, the first `rows` real) times tiles [tile_begin, tile_end), cut as amx_range
// cuts it.
template <typename X>
static void w8a8_amx_range(const AmxRows& a, int64_t K, const float* x_scales, int64_t rows, const int8_t* tiles,
                           const float* bias, X* out, int64_t N, int64_t tile_begin, int64_t tile_end) {
  const int64_t lines = K / 4, tile_bytes = (lines + 2) * kW8A8LineBytes;
  const auto finish = [&](int64_t m0, int64_t block_rows, int64_t t0, int64_t group_tiles, const char* sums,
                          int64_t stride) {
    for (int64_t t = 0; t < group_tiles; ++t) {
      const int8_t* tail = tiles + (t0 + t) * tile_bytes + lines * kW8A8LineBytes;
      const __m512 w_scales = _mm512_loadu_ps(tail);
      const __m512i offsets = _mm512_loadu_si512(tail + kW8A8LineBytes);
      const int64_t n = (t0 + t) * kW8A8Lanes;
      const __mmask16 mask = vmask_first(N - n);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
      for (int64_t r = 0; r < block_rows && m0 + r < rows; ++r) {
        const __m512i line = _mm512_load_si512(sums + r * stride + t * 64);
        const __m512 summed = _mm512_cvtepi32_ps(_mm512_sub_epi32(line, offsets));
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(x_scales[m0 + r]), w_scales);
        vstore_masked(out + (m0 + r) * N + n, _mm512_fmadd_ps(summed, scale, b), mask);
      }
    }
  };
  amx_range<AmxProduct::kBytes>(a, reinterpret_cast<const char*>(tiles), tile_bytes, lines / kAmxW8A8Lines,
                                tile_begin, tile_end, finish);
}
#endif
#endif

template <typename Block>
using BlockTable = Block[4][6];
#define PATCHBAY_ROWS(F, T) {F<1, T>, F<2, T>, F<3, T>, F<4, T>, F<5, T>, F<6, T>}
#define PATCHBAY_BLOCKS(F) {PATCHBAY_ROWS(F, 1), PATCHBAY_ROWS(F, 2), PATCHBAY_ROWS(F, 3), PATCHBAY_ROWS(F, 4)}

// Every row of x times the tiles [tile_begin, tile_end), a block of rows by up to `max_tiles` tiles at a time
// (the block's weights stay in cache while its rows pass); `extra` is the block's bias or scales.  The output is in
// the activations' dtype, except where the activations come widened to float32.
template <typename X, typename W, typename E, typename O, typename Block>
static void tile_range(const BlockTable<Block>& blocks, int max_tiles, const X* x, int64_t ldx, int64_t rows,
                       const W* tiles, int64_t tile_elements, int64_t depth, const E* extra, O* out, int64_t ldo,
                       int64_t lanes, int64_t N, int64_t tile_begin, int64_t tile_end) {
  for (int64_t t0 = tile_begin; t0 < tile_end; t0 += max_tiles) {
    const int64_t tiles_here = std::min<int64_t>(max_tiles, tile_end - t0);
    const W* panel = tiles + t0 * tile_elements;
    for (int64_t m0 = 0; m0 < rows; m0 += 6) {
      const int64_t rows_here = std::min<int64_t>(6, rows - m0);
      blocks[tiles_here - 1][rows_here - 1](x + m0 * ldx, ldx, panel, depth, extra, out + m0 * ldo, ldo,
                                            t0 * lanes, N);
    }
  }
}

int64_t float32_lanes() {
#ifdef PATCHBAY_SIMD
  return kLanes;
#else
  return 0;
#endif
}

bool bfloat16_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// The kernel of bfloat16 tiles, by name: "pairs" (vdpbf16ps) or "fma" (widened to float32); returns the previous.
std::string use_bfloat16_kernel(const std::string& name) {
  TORCH_CHECK(name == "pairs" || name == "fma", "bfloat16 tile kernels are 'pairs' and 'fma', not '", name, "'");
  const bool previous = bf16_through_fma.exchange(name == "fma");
  return previous ? "fma" : "pairs";
}

// Products of up to `rows` rows run the pair dot product under the "fma" kernel too; returns the previous limit.
int64_t use_bfloat16_pairs_up_to(int64_t rows) {
  TORCH_CHECK(rows >= 0, "use_bfloat16_pairs_up_to takes a row count of 0 or more, not ", rows);
  return bf16_pairs_max_rows.exchange(rows);
}

// Whether bfloat16 tiles can run through AMX here: built for a CPU with AMX-BF16, and Linux lets this process
// use its tile registers.
bool bfloat16_amx_supported() {
#if defined(PATCHBAY_AMX_BF16)
  return amx_permitted();
#else
  return false;
#endif
}

// Products of at least `rows` rows run through AMX where bfloat16_amx_supported() (0: never); returns the previous.
int64_t use_bfloat16_amx_from(int64_t rows) {
  TORCH_CHECK(rows >= 0, "use_bfloat16_amx_from takes a row count of 0 or more, not ", rows);
  return bf16_amx_from_rows.exchange(rows);
}

// Bytes of one int4 block (0: this build has no int4 tiles).
int64_t int4_block_bytes() {
#ifdef PATCHBAY_INT4
  return kInt4BlockBytes;
#else
  return 0;
#endif
}

// x: [rows, K] float32 or bfloat16; tiles: uint8 [N/8][K/32][int4_block_bytes()]; bias: any float dtype.
torch::Tensor tiled_int4_linear(torch::Tensor x, torch::Tensor tiles, c10::optional<torch::Tensor> bias,
                                int64_t out_features, int64_t threads) {
#ifdef PATCHBAY_INT4
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "tiled_int4_linear takes rows of contiguous features");
  TORCH_CHECK(tiles.scalar_type() == torch::kUInt8 && tiles.is_contiguous() && tiles.dim() == 3
              && tiles.size(2) == kInt4BlockBytes && x.size(1) == tiles.size(1) * kInt4Group,
              "int4 tiles are uint8 [N/8][K/32][block bytes]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "tiled_int4_linear takes float32 or bfloat16 activations");
  const int64_t rows = x.size(0), K = x.size(1), N = out_features, n_tiles = tiles.size(0), groups = tiles.size(1);
  TORCH_CHECK(N <= n_tiles * kInt4Lanes, "tiled_int4_linear: more output features than tiles");
  auto out = torch::empty({rows, N}, x.options());
  if (rows == 0) return out;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->contiguous().to(torch::kFloat32);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto levels = torch::empty({rows, K}, x.options().dtype(torch::kInt8));
  auto per_group = torch::empty({2, rows, groups}, x.options().dtype(torch::kFloat32));
  float* scales = per_group.data_ptr<float>();
  float* sums = scales + rows * groups;
  if (x.scalar_type() == torch::kFloat32)
    quantize_rows(x.data_ptr<float>(), x.stride(0), rows, K, levels.data_ptr<int8_t>(), scales, sums, threads);
  else
    quantize_rows(x.data_ptr<at::BFloat16>(), x.stride(0), rows, K, levels.data_ptr<int8_t>(), scales, sums, threads);
  const Int8Rows quantized{levels.data_ptr<int8_t>(), scales, sums, K, groups};
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const int64_t per_chunk = chunk_tiles(n_tiles, kInt4Tiles, threads);
  const int64_t chunks = (n_tiles + per_chunk - 1) / per_chunk;
  if (x.scalar_type() == torch::kFloat32) {
    float* op = out.data_ptr<float>();
    ChunkPool::instance().run(threads, chunks, [&](int64_t chunk) {
      int4_tile_range(quantized, rows, tp, bp, op, N, chunk * per_chunk, std::min(n_tiles, (chunk + 1) * per_chunk));
    }, weights_of(tiles));
  } else {
    auto* op = out.data_ptr<at::BFloat16>();
    ChunkPool::instance().run(threads, chunks, [&](int64_t chunk) {
      int4_tile_range(quantized, rows, tp, bp, op, N, chunk * per_chunk, std::min(n_tiles, (chunk + 1) * per_chunk));
    }, weights_of(tiles));
  }
  return out;
#else
  TORCH_CHECK(false, "tiled_int4_linear needs AVX2 with FMA and F16C");
#endif
}

// Output features per W8A8 tile (0: this build has no W8A8 tiles: they need AVX512-VNNI and AVX512-BW).
// W8A8 products of at least this many rows run through AMX where the CPU has it (0: never).
static std::atomic<int64_t> w8a8_amx_from_rows{0};

// Whether W8A8 tiles can run through AMX here: built for a CPU with AMX-INT8, and Linux lets this process use it.
bool w8a8_amx_supported() {
#if defined(PATCHBAY_AMX_W8A8)
  return amx_permitted();
#else
  return false;
#endif
}

// W8A8 products of at least `rows` rows run through AMX where w8a8_amx_supported() (0: never); returns the previous.
int64_t use_w8a8_amx_from(int64_t rows) {
  TORCH_CHECK(rows >= 0, "use_w8a8_amx_from takes a row count of 0 or more, not ", rows);
  return w8a8_amx_from_rows.exchange(rows);
}

int64_t w8a8_lanes() {
#ifdef PATCHBAY_W8A8
  return kW8A8Lanes;
#else
  return 0;
#endif
}

// x: [rows, K] float32 or bfloat16; tiles: int8 [N/16][K/4 + 2][64] (see w8a8_block); bias: any float dtype.
torch::Tensor tiled_w8a8_linear(torch::Tensor x, torch::Tensor tiles, c10::optional<torch::Tensor> bias,
                                int64_t out_features, int64_t threads) {
#ifdef PATCHBAY_W8A8
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "tiled_w8a8_linear takes rows of contiguous features");
  TORCH_CHECK(tiles.scalar_type() == torch::kInt8 && tiles.is_contiguous() && tiles.dim() == 3
              && tiles.size(2) == kW8A8LineBytes && x.size(1) == 4 * (tiles.size(1) - 2),
              "W8A8 tiles are int8 [N/16][K/4 + 2][64]");
  TORCH_CHECK(x.size(1) < (1 << 16), "tiled_w8a8_linear: int32 sums hold at most 65535 input features");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "tiled_w8a8_linear takes float32 or bfloat16 activations");
  const int64_t rows = x.size(0), K = x.size(1), N = out_features, n_tiles = tiles.size(0);
  TORCH_CHECK(N <= n_tiles * kW8A8Lanes, "tiled_w8a8_linear: more output features than tiles");
  auto out = torch::empty({rows, N}, x.options());
  if (rows == 0) return out;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->contiguous().to(torch::kFloat32);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if defined(PATCHBAY_AMX_W8A8)
  const int64_t amx_from = w8a8_amx_from_rows.load(std::memory_order_relaxed);
  const bool amx = amx_from > 0 && rows >= amx_from && (K / 4) % kAmxW8A8Lines == 0 && amx_permitted();
  const int64_t padded_rows = amx ? (rows + kAmxRows - 1) / kAmxRows * kAmxRows : rows;
#else
  const int64_t padded_rows = rows;
#endif
  auto levels = torch::empty({padded_rows, K}, x.options().dtype(torch::kUInt8));
  auto x_scales = torch::empty({rows}, x.options().dtype(torch::kFloat32));
  uint8_t* lp = levels.data_ptr<uint8_t>();
  std::memset(lp + rows * K, 0, static_cast<size_t>((padded_rows - rows) * K));  // AMX's last slice reads them
  float* sp = x_scales.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  constexpr int64_t kRowsPerChunk = 8;
  const int64_t row_chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  const int8_t* tp = tiles.data_ptr<int8_t>();
  const int64_t per_chunk = chunk_tiles(n_tiles, kW8A8Tiles, threads);
  const int64_t chunks = (n_tiles + per_chunk - 1) / per_chunk;
  auto run = [&](auto* xp, auto* op) {
    ChunkPool::instance().run(rows >= 2 * kRowsPerChunk ? static_cast<int>(threads) : 1, row_chunks, [&](int64_t c) {
      for (int64_t m = c * kRowsPerChunk; m < std::min(rows, (c + 1) * kRowsPerChunk); ++m)
        sp[m] = quantize_row_w8a8(xp + m * ldx, K, lp + m * K);
    });
#if defined(PATCHBAY_AMX_W8A8)
    if (amx) {
      const int64_t amx_per_chunk = chunk_tiles(n_tiles, 2, threads);
      ChunkPool::instance().run(threads, (n_tiles + amx_per_chunk - 1) / amx_per_chunk, [&](int64_t chunk) {
        w8a8_amx_range(AmxRows{reinterpret_cast<const char*>(lp), K, padded_rows / kAmxRows, nullptr}, K, sp, rows, tp,
                       bp, op, N, chunk * amx_per_chunk,
                       std::min(n_tiles, (chunk + 1) * amx_per_chunk));
      }, weights_of(tiles));
      return;
    }
#endif
    ChunkPool::instance().run(threads, chunks, [&](int64_t chunk) {
      w8a8_tile_range(lp, K, sp, rows, tp, bp, op, N, chunk * per_chunk, std::min(n_tiles, (chunk + 1) * per_chunk));
    }, weights_of(tiles));
  };
  if (x.scalar_type() == torch::kFloat32)
    run(x.data_ptr<float>(), out.data_ptr<float>());
  else
    run(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
#else
  TORCH_CHECK(false, "tiled_w8a8_linear needs AVX512-VNNI and AVX512-BW");
#endif
}

torch::Tensor tiled_linear(torch::Tensor x, torch::Tensor tiles, c10::optional<torch::Tensor> bias,
                           int64_t out_features, int64_t threads) {
  // GGUF block tiles (4-D) and int4 tiles (3-D) carry their own scales; the fused decoder layer reaches them
  // through this entry too.
  if (is_block_tiles(tiles)) return block_tiles_linear(x, tiles, bias, out_features, threads);
  if (tiles.scalar_type() == torch::kUInt8) return tiled_int4_linear(x, tiles, bias, out_features, threads);
  // So do W8A8 tiles (weight-only int8 tiles never come here: their scales lie apart, see tiled_int8_linear).
  if (tiles.scalar_type() == torch::kInt8) return tiled_w8a8_linear(x, tiles, bias, out_features, threads);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "tiled_linear takes rows of contiguous features");
  TORCH_CHECK(tiles.is_contiguous() && (tiles.dim() == 3 || tiles.dim() == 4), "tiled_linear takes tiled weights");
  TORCH_CHECK(x.scalar_type() == tiles.scalar_type(), "tiled_linear: inputs and weights differ in dtype");
  const int64_t rows = x.size(0);
  const int64_t N = out_features;
  auto out = torch::empty({rows, N}, x.options());
  if (rows == 0) return out;
  const int64_t n_tiles = tiles.size(0);
  const int64_t tile_elements = tiles.numel() / n_tiles;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->contiguous().to(x.scalar_type());
  if (x.scalar_type() == torch::kBFloat16) {
#if defined(__AVX512BF16__)
    static const BlockTable<decltype(&bf16_block<1, 1>)> blocks = PATCHBAY_BLOCKS(bf16_block);
    TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == 16 && tiles.size(3) == 2, "bfloat16 tiles are [N/16][K/2][16][2]");
    TORCH_CHECK(x.size(1) == 2 * tiles.size(1) && x.stride(0) % 2 == 0, "tiled_linear: feature count mismatch");
    const auto* xp = x.data_ptr<at::BFloat16>();
    const auto* tp = tiles.data_ptr<at::BFloat16>();
    const auto* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
    auto* op = out.data_ptr<at::BFloat16>();
    const int64_t ldx = x.stride(0), pairs = tiles.size(1);
#if defined(PATCHBAY_AMX_BF16)
    const int64_t amx_from = bf16_amx_from_rows.load(std::memory_order_relaxed);
    if (amx_from > 0 && rows >= amx_from && pairs % kAmxPairs == 0 && amx_permitted()) {
      AmxRows a{reinterpret_cast<const char*>(xp), ldx * 2, rows / kAmxRows, nullptr};
      thread_local std::vector<c10::BFloat16> tail;
      if (const int64_t tail_rows = rows % kAmxRows) {  // the last slice's missing rows read as zeros
        constexpr int64_t kAligned = 32;  // bfloat16s in 64 bytes
        tail.assign(static_cast<size_t>(kAmxRows * ldx + kAligned), c10::BFloat16(0.0f));
        c10::BFloat16* rows_copy = tail.data() + (-reinterpret_cast<intptr_t>(tail.data()) & 63) / 2;
        for (int64_t r = 0; r < tail_rows; ++r)
          std::memcpy(rows_copy + r * ldx, xp + (a.full * kAmxRows + r) * ldx, 2 * pairs * sizeof(c10::BFloat16));
        a.tail = reinterpret_cast<const char*>(rows_copy);
      }
      const int64_t per_chunk = chunk_tiles(n_tiles, 2, threads);
      ChunkPool::instance().run(threads, (n_tiles + per_chunk - 1) / per_chunk, [&](int64_t chunk) {
        bf16_amx_range(a, rows, tp, pairs, bp, op, N, N, chunk * per_chunk,
                       std::min(n_tiles, (chunk + 1) * per_chunk));
      }, weights_of(tiles));
      return out;
    }
#endif
    if (bf16_through_fma.load(std::memory_order_relaxed) && rows > bf16_pairs_max_rows.load(std::memory_order_relaxed)) {
      static const BlockTable<decltype(&bf16_fma_block<1, 1>)> fma_blocks = PATCHBAY_BLOCKS(bf16_fma_block);
      const int64_t K = 2 * pairs;
      const float* widened = widen_rows(xp, ldx, rows, K);
      const int64_t per_chunk = chunk_tiles(n_tiles, kBf16FmaTiles, threads);
      ChunkPool::instance().run(threads, (n_tiles + per_chunk - 1) / per_chunk, [&](int64_t chunk) {
        tile_range(fma_blocks, kBf16FmaTiles, widened, K, rows, tp, tile_elements, pairs, bp, op, N, 16, N,
                   chunk * per_chunk, std::min(n_tiles, (chunk + 1) * per_chunk));
      }, weights_of(tiles));
      return out;
    }
    const int64_t per_chunk = chunk_tiles(n_tiles, kBf16Tiles, threads);
    ChunkPool::instance().run(threads, (n_tiles + per_chunk - 1) / per_chunk, [&](int64_t chunk) {
      tile_range(blocks, kBf16Tiles, xp, ldx, rows, tp, tile_elements, pairs, bp, op, N, 16, N, chunk * per_chunk,
                 std::min(n_tiles, (chunk + 1) * per_chunk));
    }, weights_of(tiles));
    return out;
#else
    TORCH_CHECK(false, "tiled_linear: bfloat16 needs AVX512-BF16");
#endif
  }
#ifdef PATCHBAY_SIMD
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "tiled_linear runs on float32 or bfloat16");
  static const BlockTable<decltype(&f32_block<1, 1>)> blocks = PATCHBAY_BLOCKS(f32_block);
  TORCH_CHECK(tiles.dim() == 3 && tiles.size(2) == kLanes && x.size(1) == tiles.size(1),
              "float32 tiles are [N/lanes][K][lanes]");
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* tp = tiles.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), K = tiles.size(1);
  const int64_t per_chunk = chunk_tiles(n_tiles, kLaneTiles, threads);
  ChunkPool::instance().run(threads, (n_tiles + per_chunk - 1) / per_chunk, [&](int64_t chunk) {
    tile_range(blocks, kLaneTiles, xp, ldx, rows, tp, tile_elements, K, bp, op, N, kLanes, N, chunk * per_chunk,
               std::min(n_tiles, (chunk + 1) * per_chunk));
  }, weights_of(tiles));
  return out;
#else
  TORCH_CHECK(false, "tiled_linear needs AVX-512 or AVX2");
#endif
}

// x: [rows, K] float32 or bfloat16; tiles: int8 [N/lanes][K][lanes]; scales: float32, N padded to whole tiles.
torch::Tensor tiled_int8_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales, int64_t out_features,
                                int64_t threads) {
#ifdef PATCHBAY_SIMD
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "tiled_int8_linear takes rows of contiguous features");
  TORCH_CHECK(tiles.scalar_type() == torch::kInt8 && tiles.is_contiguous() && tiles.dim() == 3
              && tiles.size(2) == kLanes && x.size(1) == tiles.size(1), "int8 tiles are [N/lanes][K][lanes]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous()
              && scales.numel() == tiles.size(0) * kLanes, "one float32 scale per padded output feature expected");
  const int64_t rows = x.size(0), N = out_features, n_tiles = tiles.size(0), K = tiles.size(1);
  auto out = torch::empty({rows, N}, x.options());
  if (rows == 0) return out;
  const int8_t* tp = tiles.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t ldx = x.stride(0), tile_elements = K * kLanes;
  const int64_t per_chunk = chunk_tiles(n_tiles, kLaneTiles, threads);
  const int64_t chunks = (n_tiles + per_chunk - 1) / per_chunk;
  if (x.scalar_type() == torch::kFloat32) {
    static const BlockTable<decltype(&int8_block_f32<1, 1>)> blocks = PATCHBAY_BLOCKS(int8_block_f32);
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    ChunkPool::instance().run(threads, chunks, [&](int64_t chunk) {
      tile_range(blocks, kLaneTiles, xp, ldx, rows, tp, tile_elements, K, sp, op, N, kLanes, N, chunk * per_chunk,
                 std::min(n_tiles, (chunk + 1) * per_chunk));
    }, weights_of(tiles));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "tiled_int8_linear takes float32 or bfloat16 activations");
    static const BlockTable<decltype(&int8_block_bf16<1, 1>)> blocks = PATCHBAY_BLOCKS(int8_block_bf16);
    const auto* xp = x.data_ptr<at::BFloat16>();
    auto* op = out.data_ptr<at::BFloat16>();
    ChunkPool::instance().run(threads, chunks, [&](int64_t chunk) {
      tile_range(blocks, kLaneTiles, xp, ldx, rows, tp, tile_elements, K, sp, op, N, kLanes, N, chunk * per_chunk,
                 std::min(n_tiles, (chunk + 1) * per_chunk));
    }, weights_of(tiles));
  }
  return out;
#else
  TORCH_CHECK(false, "tiled_int8_linear needs AVX-512 or AVX2");
#endif
}

// tiled_linear for other extensions' kernels (the fused decoder layer's), by the address tiled_product() hands out.
static void tiled_linear_into(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor* bias,
                              int64_t out_features, int64_t threads, torch::Tensor& out) {
  out = tiled_linear(x, tiles, bias ? c10::optional<torch::Tensor>(*bias) : c10::nullopt, out_features, threads);
}

int64_t tiled_product() { return reinterpret_cast<int64_t>(&tiled_linear_into); }

// The kernels run without the GIL: a server's asyncio thread streams while the engine thread is in them
// (docs/design/cpu-fast-paths.md#kernels-and-the-gil).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tiled_linear", torch::wrap_pybind_function_no_gil(tiled_linear), "tiled_linear");
  m.def("tiled_int8_linear", torch::wrap_pybind_function_no_gil(tiled_int8_linear), "tiled_int8_linear");
  m.def("tiled_int4_linear", torch::wrap_pybind_function_no_gil(tiled_int4_linear), "tiled_int4_linear");
  m.def("tiled_w8a8_linear", torch::wrap_pybind_function_no_gil(tiled_w8a8_linear), "tiled_w8a8_linear");
  m.def("w8a8_lanes", torch::wrap_pybind_function(w8a8_lanes), "w8a8_lanes");
  m.def("int4_block_bytes", torch::wrap_pybind_function(int4_block_bytes), "int4_block_bytes");
  m.def("float32_lanes", torch::wrap_pybind_function(float32_lanes), "float32_lanes");
  m.def("bfloat16_supported", torch::wrap_pybind_function(bfloat16_supported), "bfloat16_supported");
  m.def("bfloat16_amx_supported", torch::wrap_pybind_function(bfloat16_amx_supported), "bfloat16_amx_supported");
  m.def("use_bfloat16_amx_from", torch::wrap_pybind_function(use_bfloat16_amx_from), "use_bfloat16_amx_from");
  m.def("w8a8_amx_supported", torch::wrap_pybind_function(w8a8_amx_supported), "w8a8_amx_supported");
  m.def("use_w8a8_amx_from", torch::wrap_pybind_function(use_w8a8_amx_from), "use_w8a8_amx_from");
  m.def("use_bfloat16_kernel", torch::wrap_pybind_function(use_bfloat16_kernel), "use_bfloat16_kernel");
  m.def("use_bfloat16_pairs_up_to", torch::wrap_pybind_function(use_bfloat16_pairs_up_to), "use_bfloat16_pairs_up_to");
  m.def("chunk_runner", torch::wrap_pybind_function(chunk_runner), "chunk_runner");
  m.def("chunk_pool_self_check", torch::wrap_pybind_function_no_gil(chunk_pool_self_check), "chunk_pool_self_check");
  m.def("chunk_pool_read_ahead", torch::wrap_pybind_function_no_gil(chunk_pool_read_ahead), "chunk_pool_read_ahead");
  m.def("tiled_product", torch::wrap_pybind_function(tiled_product), "tiled_product");
  bind_block_tiles(m);
}
