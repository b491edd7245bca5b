// Causal attention of long prefill chunks through AMX tiles (patchbay.plugins.attention._cpu_kernel).
//
// In a long bfloat16 prefill on a CPU with AMX, torch's CPU flash attention spent most of its time outside its
// tile products: in its softmax's exponentials and in rescaling its partial output block after block.  Here a
// query head's 16 rows (a row tile) keep their output in four tile registers (16 rows by 64 float32 features)
// while 32 keys at a time pass, and it is rescaled only when a row's scores outgrow the maximum its
// exponentials are taken against by more than 2^8 (in powers of two), which after a row's first blocks is rare:
// an exponential up to 2^8 larger is still exact enough in float32 sums and bfloat16 probabilities.  The
// exponentials are a power of two (scalef) times a degree-4 polynomial of the fraction.  Probabilities are
// rounded to bfloat16 for their product with the values, as torch's kernel rounds them; scores, sums and the
// output are float32 until the output is written.  A task takes every query head of one KV head over 8 row
// tiles, in passes of 256 keys that all its row tiles use while the keys are in cache.
#include "prefill_attention.h"
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define PATCHBAY_AMX_PREFILL 1
#include "amx.h"
#endif

#ifdef PATCHBAY_AMX_PREFILL
namespace {

constexpr int64_t kHead = 64;           // head size: two 32-feature query tiles, four 16-feature output tiles
constexpr int64_t kQueryRows = 16;      // query rows per task: one tile's
constexpr int64_t kBlockKeys = 32;      // keys per step: two 16-key score tiles, one 32-key probability tile
constexpr int64_t kTileElements = 512;  // bfloat16 elements of one tile of 16 rows by 64 bytes
constexpr float kRescaleAbove = 8.0f;   // log2 of how far a row's scores may outgrow the maximum in use
constexpr int64_t kTaskRowTiles = 8;    // row tiles per task (of every query head of one KV head)
constexpr int64_t kPassBlocks = 8;      // key blocks per pass: 256 keys, 64 KiB of packed keys and values

// 2^x for x <= kRescaleAbove: 2^round(x) (scalef: 0 far below) times 2^f for the fraction |f| <= 1/2, by the
// degree-4 Taylor polynomial of e^(f ln 2) (relative error under 6e-5, a thirtieth of bfloat16's rounding).
inline __m512 exp2_of(__m512 x) {
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr float c1 = kLn2, c2 = c1 * kLn2 / 2, c3 = c2 * kLn2 / 3, c4 = c3 * kLn2 / 4;
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(c4), f, _mm512_set1_ps(c3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Each KV head's keys and values in the layouts AMX takes as its second operand, zero past the last key:
// keys, per 16-key slice s and 32-feature half h: [16 feature pairs p][16 keys n][2] = K[16s + n][32h + 2p + e];
// values, per 32-key block b and 16-feature quarter q: [16 key pairs p][16 features n][2] = V[32b + 2p + e][16q + n].
struct PackedKV {
  int64_t blocks;  // 32-key blocks per KV head
  uint16_t* keys;
  uint16_t* values;

  uint16_t* key_tile(int64_t kv_head, int64_t slice, int64_t half) const {
    return keys + ((kv_head * blocks * 2 + slice) * 2 + half) * kTileElements;
  }
  uint16_t* value_tile(int64_t kv_head, int64_t block, int64_t quarter) const {
    return values + ((kv_head * blocks + block) * 4 + quarter) * kTileElements;
  }
};

// A [tokens, heads, 64] bfloat16 tensor's rows, by token and head.
struct Rows {
  uint16_t* data;
  int64_t token_stride, head_stride;

  explicit Rows(const torch::Tensor& t)
      : data(reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>())), token_stride(t.stride(0)),
        head_stride(t.stride(1)) {}
  uint16_t* row(int64_t token, int64_t head) const { return data + token * token_stride + head * head_stride; }
};

void pack_block(const Rows& keys, const Rows& values, int64_t num_keys, int64_t kv_head, int64_t block,
                const PackedKV& packed) {
  for (int64_t slice = 2 * block; slice < 2 * block + 2; ++slice) {
    for (int64_t half = 0; half < 2; ++half) {
      uint16_t* tile = packed.key_tile(kv_head, slice, half);
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t key = 16 * slice + n;
        const uint16_t* features = key < num_keys ? keys.row(key, kv_head) + 32 * half : nullptr;
        for (int64_t p = 0; p < 16; ++p) {
          tile[(p * 16 + n) * 2] = features ? features[2 * p] : 0;
          tile[(p * 16 + n) * 2 + 1] = features ? features[2 * p + 1] : 0;
        }
      }
    }
  }
  for (int64_t quarter = 0; quarter < 4; ++quarter) {
    uint16_t* tile = packed.value_tile(kv_head, block, quarter);
    for (int64_t p = 0; p < 16; ++p) {
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t key = kBlockKeys * block + 2 * p + e;
        const uint16_t* features = key < num_keys ? values.row(key, kv_head) + 16 * quarter : nullptr;
        for (int64_t n = 0; n < 16; ++n) tile[(p * 16 + n) * 2 + e] = features ? features[n] : 0;
      }
    }
  }
}

struct Prefill {
  Rows query, output;
  PackedKV packed;
  int64_t q_len, group, context_len;
  float scale_log2;  // the softmax scale times log2(e): scores in powers of two
};

// One query head's 16 rows between passes over the keys: their queries, running maximum (in powers of two) and
// softmax denominators, and their output while it is out of the tile registers.
struct RowTile {
  alignas(64) uint16_t queries[kQueryRows * kHead];
  alignas(64) float output[kQueryRows * kHead];
  alignas(64) float sums[kQueryRows * 16];  // per row, 16 lanes of its denominator
  float maximum[kQueryRows];
  int32_t last_key[kQueryRows];  // the last key a row sees (padding rows: the last real row's)
  int64_t head, first_row, rows;
  int64_t blocks;        // 32-key blocks the rows see
  int64_t seen_by_all;   // keys below this every row sees: blocks that end there need no mask

  RowTile(const Prefill& job, int64_t head_, int64_t tile) : head(head_), first_row(tile * kQueryRows) {
    rows = std::min(kQueryRows, job.q_len - first_row);
    for (int64_t r = 0; r < kQueryRows; ++r) {
      if (r < rows) std::memcpy(queries + r * kHead, job.query.row(first_row + r, head), kHead * sizeof(uint16_t));
      else std::memset(queries + r * kHead, 0, kHead * sizeof(uint16_t));
      last_key[r] = static_cast<int32_t>(job.context_len + first_row + std::min(r, rows - 1));
      maximum[r] = -FLT_MAX;
    }
    std::memset(output, 0, sizeof(output));
    std::memset(sums, 0, sizeof(sums));
    blocks = last_key[kQueryRows - 1] / kBlockKeys + 1;
    seen_by_all = job.context_len + first_row + 1;
  }
};

// Scratch of one task: two blocks' scores (one being computed while the other is weighed) and one block's
// probabilities as bfloat16.
struct BlockScratch {
  alignas(64) float scores[2][kQueryRows * kBlockKeys];
  alignas(64) uint16_t probabilities[kQueryRows * kBlockKeys];
};

// The row tile's scores against keys [32 block, 32 block + 32) into `scores` [16 rows][32 keys], through tiles 4
// and 5 (16 keys each), 6 (queries) and 7 (keys).
void score_block(const Prefill& job, int64_t kv_head, const RowTile& rows, int64_t block, float* scores) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_loadd(6, rows.queries, kHead * 2);
  _tile_loadd(7, job.packed.key_tile(kv_head, 2 * block, 0), 64);
  _tile_dpbf16ps(4, 6, 7);
  _tile_loadd(7, job.packed.key_tile(kv_head, 2 * block + 1, 0), 64);
  _tile_dpbf16ps(5, 6, 7);
  _tile_loadd(6, rows.queries + 32, kHead * 2);
  _tile_loadd(7, job.packed.key_tile(kv_head, 2 * block, 1), 64);
  _tile_dpbf16ps(4, 6, 7);
  _tile_loadd(7, job.packed.key_tile(kv_head, 2 * block + 1, 1), 64);
  _tile_dpbf16ps(5, 6, 7);
  _tile_stored(4, scores, kBlockKeys * 4);
  _tile_stored(5, scores + 16, kBlockKeys * 4);
}

// Key block `block`, whose scores are in `scores`, for a row tile whose output is in tile registers 0-3: the
// softmax's exponentials (rescaling the output where a row's maximum moves), then output += probabilities x values
// through tiles 6 and 7.
void weigh_block(const Prefill& job, int64_t kv_head, RowTile& rows, int64_t block, const float* scores,
                 uint16_t* probabilities) {
  const bool masked = kBlockKeys * (block + 1) > rows.seen_by_all;
  const __m512 scale = _mm512_set1_ps(job.scale_log2);
  const __m512i low_keys = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(kBlockKeys * block)),
                                            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  const __m512i high_keys = _mm512_add_epi32(low_keys, _mm512_set1_epi32(16));
  float rescale[kQueryRows];
  bool any_rescaled = false;
  for (int64_t r = 0; r < kQueryRows; ++r) {
    __mmask16 low = 0xFFFF, high = 0xFFFF;
    if (masked) {
      const __m512i last = _mm512_set1_epi32(rows.last_key[r]);
      low = _mm512_cmple_epi32_mask(low_keys, last);
      high = _mm512_cmple_epi32_mask(high_keys, last);
    }
    const __m512 s_low = _mm512_load_ps(scores + r * kBlockKeys);
    const __m512 s_high = _mm512_load_ps(scores + r * kBlockKeys + 16);
    // Block 0 holds key 0, which every row sees: each row's maximum is set there.  The scale is positive, so
    // scores are compared with the limit unscaled.
    const __m512 limit = _mm512_set1_ps(block == 0 ? -FLT_MAX : (rows.maximum[r] + kRescaleAbove) / job.scale_log2);
    rescale[r] = 1.0f;
    if (_mm512_mask_cmp_ps_mask(low, s_low, limit, _CMP_GT_OQ) | _mm512_mask_cmp_ps_mask(high, s_high, limit, _CMP_GT_OQ)) {
      const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
      const float block_maximum = job.scale_log2 * _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_mask_blend_ps(low, lowest, s_low), _mm512_mask_blend_ps(high, lowest, s_high)));
      if (block > 0) {
        rescale[r] = std::exp2(rows.maximum[r] - block_maximum);
        _mm512_store_ps(rows.sums + r * 16,
                        _mm512_mul_ps(_mm512_load_ps(rows.sums + r * 16), _mm512_set1_ps(rescale[r])));
        any_rescaled = true;
      }
      rows.maximum[r] = block_maximum;
    }
    const __m512 shift = _mm512_set1_ps(rows.maximum[r]);
    __m512 p_low = exp2_of(_mm512_fmsub_ps(s_low, scale, shift));
    __m512 p_high = exp2_of(_mm512_fmsub_ps(s_high, scale, shift));
    if (masked) {
      p_low = _mm512_maskz_mov_ps(low, p_low);
      p_high = _mm512_maskz_mov_ps(high, p_high);
    }
    _mm512_store_ps(rows.sums + r * 16, _mm512_add_ps(_mm512_load_ps(rows.sums + r * 16), _mm512_add_ps(p_low, p_high)));
    _mm512_store_si512(probabilities + r * kBlockKeys, (__m512i)_mm512_cvtne2ps_pbh(p_high, p_low));
  }
  if (any_rescaled) {
    _tile_stored(0, rows.output, kHead * 4);
    _tile_stored(1, rows.output + 16, kHead * 4);
    _tile_stored(2, rows.output + 32, kHead * 4);
    _tile_stored(3, rows.output + 48, kHead * 4);
    for (int64_t r = 0; r < kQueryRows; ++r) {
      if (rescale[r] == 1.0f) continue;
      const __m512 factor = _mm512_set1_ps(rescale[r]);
      for (int64_t i = 0; i < kHead; i += 16)
        _mm512_store_ps(rows.output + r * kHead + i, _mm512_mul_ps(_mm512_load_ps(rows.output + r * kHead + i), factor));
    }
    _tile_loadd(0, rows.output, kHead * 4);
    _tile_loadd(1, rows.output + 16, kHead * 4);
    _tile_loadd(2, rows.output + 32, kHead * 4);
    _tile_loadd(3, rows.output + 48, kHead * 4);
  }
  // The output's four 16-feature quarters += probabilities [16 rows, 32 keys] x values [32 keys, 16 features].
  _tile_loadd(6, probabilities, kBlockKeys * 2);
  _tile_loadd(7, job.packed.value_tile(kv_head, block, 0), 64);
  _tile_dpbf16ps(0, 6, 7);
  _tile_loadd(7, job.packed.value_tile(kv_head, block, 1), 64);
  _tile_dpbf16ps(1, 6, 7);
  _tile_loadd(7, job.packed.value_tile(kv_head, block, 2), 64);
  _tile_dpbf16ps(2, 6, 7);
  _tile_loadd(7, job.packed.value_tile(kv_head, block, 3), 64);
  _tile_dpbf16ps(3, 6, 7);
}

// A task: every query head of KV head `kv_head` over row tiles [first_tile, end_tile).  The keys are taken
// kPassBlocks blocks at a time, each pass serving every row tile while its keys and values are in cache; a row
// tile's output moves between its tile registers and memory once per pass.
void attend_rows(const Prefill& job, int64_t kv_head, int64_t first_tile, int64_t end_tile) {
  std::vector<RowTile> tiles;
  tiles.reserve(static_cast<size_t>(job.group * (end_tile - first_tile)));
  int64_t blocks = 0;
  for (int64_t tile = first_tile; tile < end_tile; ++tile) {
    for (int64_t head = kv_head * job.group; head < (kv_head + 1) * job.group; ++head) {
      tiles.emplace_back(job, head, tile);
      blocks = std::max(blocks, tiles.back().blocks);
    }
  }
  BlockScratch scratch;
  configure_amx_tiles();
  for (int64_t pass = 0; pass < blocks; pass += kPassBlocks) {
    for (RowTile& rows : tiles) {
      const int64_t end = std::min(pass + kPassBlocks, rows.blocks);
      if (pass >= end) continue;
      _tile_loadd(0, rows.output, kHead * 4);
      _tile_loadd(1, rows.output + 16, kHead * 4);
      _tile_loadd(2, rows.output + 32, kHead * 4);
      _tile_loadd(3, rows.output + 48, kHead * 4);
      // The next block's scores are asked of the tiles before this block is weighed: the tile unit computes
      // them while the vector units take the exponentials.
      score_block(job, kv_head, rows, pass, scratch.scores[0]);
      for (int64_t block = pass; block < end; ++block) {
        if (block + 1 < end) score_block(job, kv_head, rows, block + 1, scratch.scores[(block + 1 - pass) % 2]);
        weigh_block(job, kv_head, rows, block, scratch.scores[(block - pass) % 2], scratch.probabilities);
      }
      _tile_stored(0, rows.output, kHead * 4);
      _tile_stored(1, rows.output + 16, kHead * 4);
      _tile_stored(2, rows.output + 32, kHead * 4);
      _tile_stored(3, rows.output + 48, kHead * 4);
    }
  }
  _tile_release();
  for (const RowTile& rows : tiles) {
    for (int64_t r = 0; r < rows.rows; ++r) {
      const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(rows.sums + r * 16)));
      uint16_t* out = job.output.row(rows.first_row + r, rows.head);
      for (int64_t i = 0; i < kHead; i += 16) {
        const __m512 value = _mm512_mul_ps(_mm512_load_ps(rows.output + r * kHead + i), inverse);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(value));
      }
    }
  }
}

}  // namespace
#endif

bool amx_prefill_supported() {
#ifdef PATCHBAY_AMX_PREFILL
  return amx_permitted();
#else
  return false;
#endif
}

void amx_prefill_attention(torch::Tensor query, torch::Tensor keys, torch::Tensor values, int64_t context_len,
                           double scale, torch::Tensor output, int64_t chunk_runner, int64_t threads) {
  TORCH_CHECK(amx_prefill_supported(), "amx_prefill_attention: needs AMX bfloat16 tiles and AVX512-BF16, which ",
              "this build or CPU lacks");
  for (const auto* t : {&query, &keys, &values, &output}) {
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->dim() == 3 && t->size(2) == 64 && t->stride(2) == 1
                && t->device().is_cpu(), "amx_prefill_attention: bfloat16 CPU tensors [tokens, heads, 64] with "
                "unit stride along the head expected");
  }
  const int64_t q_len = query.size(0), heads = query.size(1), num_keys = keys.size(0), kv_heads = keys.size(1);
  TORCH_CHECK(values.size(0) == num_keys && values.size(1) == kv_heads && output.size(0) == q_len
              && output.size(1) == heads, "amx_prefill_attention: keys and values of one shape, and an output of "
              "the query's, expected");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "amx_prefill_attention: query heads a multiple of KV heads");
  TORCH_CHECK(context_len >= 0 && num_keys == context_len + q_len, "amx_prefill_attention: ", num_keys,
              " keys for ", context_len, " cached and ", q_len, " new tokens");
  TORCH_CHECK(num_keys < INT32_MAX, "amx_prefill_attention: under 2^31 keys expected, got ", num_keys);
  // Scores are compared with a row's limit before they are scaled (weigh_block): that needs a positive scale.
  TORCH_CHECK(scale > 0, "amx_prefill_attention: a positive scale expected, got ", scale);
#ifdef PATCHBAY_AMX_PREFILL
  if (q_len == 0) return;
  const int64_t blocks = (num_keys + kBlockKeys - 1) / kBlockKeys;
  const auto options = keys.options().dtype(torch::kBFloat16);
  const torch::Tensor key_tiles = torch::empty({kv_heads * blocks * 4 * kTileElements}, options);
  const torch::Tensor value_tiles = torch::empty({kv_heads * blocks * 4 * kTileElements}, options);
  const PackedKV packed{blocks, reinterpret_cast<uint16_t*>(key_tiles.data_ptr<at::BFloat16>()),
                        reinterpret_cast<uint16_t*>(value_tiles.data_ptr<at::BFloat16>())};
  const RunChunks pool = reinterpret_cast<RunChunks>(chunk_runner);
  const int pool_threads = static_cast<int>(std::max<int64_t>(threads, 1));
  const Rows key_rows(keys), value_rows(values);
  run_tasks(pool, pool_threads, kv_heads * blocks, [&](int64_t i) {
    pack_block(key_rows, value_rows, num_keys, i / blocks, i % blocks, packed);
  });
  const Prefill job{Rows(query), Rows(output), packed, q_len, heads / kv_heads, context_len,
                    static_cast<float>(scale * 1.4426950408889634)};
  const int64_t row_tiles = (q_len + kQueryRows - 1) / kQueryRows;
  const int64_t row_groups = (row_tiles + kTaskRowTiles - 1) / kTaskRowTiles;
  // The last rows see the most keys: they go first, so the tasks left at the end are short.
  run_tasks(pool, pool_threads, kv_heads * row_groups, [&](int64_t i) {
    const int64_t group = row_groups - 1 - i / kv_heads;
    attend_rows(job, i % kv_heads, group * kTaskRowTiles, std::min(row_tiles, (group + 1) * kTaskRowTiles));
  });
#endif
}
