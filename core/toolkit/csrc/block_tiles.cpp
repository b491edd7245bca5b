// GGUF block tiles (patchbay.toolkit.block_tiles): the quantized blocks of a GGUF file (Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0 and the k-quants Q2_K ... Q6_K) repacked losslessly into tiles of 16 output features, multiplied by
// activations rounded to int8 per 32 inputs, and read back as float rows.
//
// Every format is, per sub-block of 16 or 32 inputs of one output feature, w = s * level + o with unsigned levels
// of 2 to 8 bits:
//   Q4_0, Q5_0, Q8_0:  s = d, o = -z * d (z = 8, 16, 128: Q8_0's signed levels are stored plus 128)
//   Q4_1, Q5_1:        s = d, o = m
//   Q2_K, Q4_K, Q5_K:  s = d * scale, o = -dmin * min   (scale and min: 4- or 6-bit integers per sub-block)
//   Q3_K, Q6_K:        s = d * scale, o = -z * s       (scale: a signed 6- or 8-bit integer; z = 4, 32)
// with d, dmin and m float16 per block (32 inputs, or a super-block of 256 for the k-quants).
//
// A tile is [blocks][block bytes]: per block, the 16 lanes' levels, then their scales.  Levels are cut into a low
// field of 2, 4 or 8 bits and a high field of 0, 1 or 2 bits, each packed in lines of 64 bytes: byte 4i + j of a
// line belongs to lane i and input 4q + j of some quad q of inputs, so that one byte product of four inputs per
// 32-bit lane (VNNI's vpdpbusd, or AVX2's vpmaddubsw) multiplies a line of levels (a 512-bit register, or two
// 256-bit ones) by four activations broadcast to every lane.  A line of b-bit fields holds 8 / b quads: quad q's
// field sits at bits [(q % (8/b)) * b, ... + b) of line q / (8/b), the low fields' lines first, then the high
// fields'.  The scales follow as arrays [item][lane]: float16 d (and dmin or m), then the integer scales (and
// mins) per sub-block as bytes.  Every bit of the file is kept; Q3_K's, Q4_K's and Q5_K's 6-bit scales take a
// byte each (2-4 % more bytes than the file), the other formats take exactly the file's bytes.
//
// The product: activations are rounded per 32 inputs to int8 (scale max|x| / 127, nearest even), as llama.cpp's
// Q8 activations are, with each 16 inputs' integer sum.  Per sub-block and lane, the integer dot product of
// levels and activations, minus z times the activations' integer sum where the format has a zero, is scaled by s
// times the activations' scale; formats with an offset add o times the activations' integer sum times their
// scale.  So the result is sum_k w[n][k] * q(x)[k] up to float32 rounding, as llama.cpp's vec_dot computes it.
#include "block_tiles.h"

#include "chunk_pool.h"
#include "simd.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kTileLanes = 16;       // output features per tile
constexpr int64_t kRegisterBytes = 64;   // bytes of one line of levels: 16 lanes x 4 inputs
constexpr int64_t kActivationGroup = 32; // inputs per int8 activation scale

// ----- The formats: their blocks in the file, in the tiles, and the weight each level stands for -----

static inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// What every format declares: inputs per block and per sub-block (one scale), bits of the low and high level
// fields, the zero z (0: none), whether an offset is added (+1: o = m) or subtracted (-1: o = dmin * min), and the
// bytes of a block in the file and of one lane's scales in a tile.
template <int INPUTS, int SUB, int LOW, int HIGH, int ZERO, int OFFSET, int FILE_BYTES, int LANE_SCALE_BYTES>
struct Layout {
  static constexpr int kInputs = INPUTS, kSub = SUB, kLowBits = LOW, kHighBits = HIGH, kZero = ZERO;
  static constexpr int kOffset = OFFSET, kFileBytes = FILE_BYTES;
  static constexpr int kLowBytes = kTileLanes * INPUTS * LOW / 8;  // the low fields' lines, then the high fields'
  static constexpr int kLevelBytes = kTileLanes * INPUTS * (LOW + HIGH) / 8;
  static constexpr int kBlockBytes = kLevelBytes + kTileLanes * LANE_SCALE_BYTES;
  static constexpr int kLaneBytes = kBlockBytes / kTileLanes;
  static_assert(INPUTS % kActivationGroup == 0 && (SUB == 16 || SUB == 32));
  static_assert(8 % LOW == 0 && (HIGH == 0 || 8 % HIGH == 0));
};

// A float16 array [item][lane] of the scales' region: item `item` of lane `lane`.
static inline const uint8_t* half_item(const uint8_t* region, int item, int lane) {
  return region + 2 * (kTileLanes * item + lane);
}
static inline void put_half(uint8_t* region, int item, int lane, const uint8_t* from) {
  std::memcpy(region + 2 * (kTileLanes * item + lane), from, 2);
}

// Legacy formats: one float16 d (and m) per block of 32.  Nibbles: byte j of the file's 16 holds input j in its
// low half and input j + 16 in its high half; Q5's fifth bits are a little-endian 32-bit word, bit j for input j.
static inline void legacy_nibbles(const uint8_t* qs, uint8_t* levels) {
  for (int j = 0; j < 16; ++j) levels[j] = qs[j] & 15, levels[j + 16] = qs[j] >> 4;
}
static inline void legacy_fifth_bits(const uint8_t* qh, uint8_t* levels) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  for (int j = 0; j < 32; ++j) levels[j] |= ((bits >> j) & 1) << 4;
}

struct Q4_0 : Layout<32, 32, 4, 0, 8, 0, 18, 2> {
  static constexpr const char* kName = "Q4_0";
  static void unpack(const uint8_t* raw, uint8_t* levels, uint8_t* region, int lane) {
    put_half(region, 0, lane, raw);
    legacy_nibbles(raw + 2, levels);
  }
  static float weight(const uint8_t* region, int lane, int, int level) {
    return half_at(half_item(region, 0, lane)) * static_cast<float>(level - kZero);
  }
};

struct Q4_1 : Layout<32, 32, 4, 0, 0, +1, 20, 4> {
  static constexpr const char* kName = "Q4_1";
  static void unpack(const uint8_t* raw, uint8_t* levels, uint8_t* region, int lane) {
    put_half(region, 0, lane, raw);
    put_half(region, 1, lane, raw + 2);
    legacy_nibbles(raw + 4, levels);
  }
  static float weight(const uint8_t* region, int lane, int, int level) {
    return half_at(half_item(region, 0, lane)) * static_cast<float>(level) + half_at(half_item(region, 1, lane));
  }
};

struct Q5_0 : Layout<32, 32, 4, 1, 16, 0, 22, 2> {
  static constexpr const char* kName = "Q5_0";
  static void unpack(const uint8_t* raw, uint8_t* levels, uint8_t* region, int lane) {
    put_half(region, 0, lane, raw);
    legacy_nibbles(raw + 6, levels);
    legacy_fifth_bits(raw + 2, levels);
  }
  static float weight(const uint8_t* region, int lane, int, int level) {
    return half_at(half_item(region, 0, lane)) * static_cast<float>(level - kZero);
  }
};

struct Q5_1 : Layout<32, 32, 4, 1, 0, +1, 24, 4> {
  static constexpr const char* kName = "Q5_1";
  static void unpack(const uint8_t* raw, uint8_t* levels, uint8_t* region, int lane) {
    put_half(region, 0, lane, raw);
    put_half(region, 1, lane, raw + 2);
    legacy_nibbles(raw + 8, levels);
    legacy_fifth_bits(raw + 4, levels);
  }
  static float weight(const uint8_t* region, int lane, int, int level) {
    return half_at(half_item(region, 0, lane)) * static_cast<float>(level) + half_at(half_item(region, 1, lane));
  }
};

struct Q8_0 : Layout<32, 32, 8, 0, 128, 0, 34, 2> {
  static constexpr const char* kName = "Q8_0";
  static void unpack(const uint8_t* raw, uint8_t* levels, uint8_t* region, int lane) {
    put_half(region, 0, lane, raw);
    for (int j = 0; j < 32; ++j) levels[j] = raw[2 + j] ^ 0x80;  // int8 q as the unsigned level q + 128
  }
  static float weight(const uint8_t* region, int lane, int, int level) {
    return static_cast<float>(level - kZero) * half_at(half_item(region, 0, lane));
  }
};

// k-quants: super-blocks of 256.  Their 2-bit fields: byte l of each 32 bytes `h` of the file's qs holds, at bits
// 2s, input 128h + 32s + l; their nibbles (Q4_K, Q5_K): byte l of 32-byte chunk c holds input 64c + l low and
// 64c + 32 + l high; their single high bits (Q3_K, Q5_K): bit i of byte l of 32 is input 32i + l.
static inline void k_crumbs(const uint8_t* qs, uint8_t* levels) {
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int l = 0; l < 32; ++l) levels[128 * h + 32 * s + l] = (qs[32 * h + l] >> (2 * s)) & 3;
}
static inline void k_nibbles(const uint8_t* qs, uint8_t* levels) {
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) levels[64 * c + l] = qs[32 * c + l] & 15, levels[64 * c + 32 + l] = qs[32 * c + l] >> 4;
}
static inline void k_high_bits(const uint8_t* bits, int shift, uint8_t* levels) {
  for (int i = 0; i < 8; ++i)
    for (int l = 0; l < 32; ++l) levels[32 * i + l] |= ((bits[l] >> i) & 1) << shift;
}
// Q4_K's and Q5_K's twelve bytes of 6-bit scales and mins: sub-blocks 0-3 in the low six bits of bytes 0-3 (scales)
// and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11, their top two bits in the top bits of bytes 0-7.
static inline void k_scales_and_mins(const uint8_t* packed, uint8_t* scales, uint8_t* mins) {
  for (int j = 0; j < 4; ++j) {
    scales[j] = packed[j] & 63, mins[j] = packed[j + 4] & 63;
    scales[j + 4] = (packed[j + 8] & 15) | ((packed[j] >> 6) << 4);
    mins[j + 4] = (packed[j + 8] >> 4) | ((packed[j + 4] >> 6) << 4);
  }
}

struct Q2_K : Layout<256, 16, 2, 0, 0, -1, 84, 20> {
  static constexpr const char* kName = "Q2_K";
  static constexpr int kScaleAt = 64;  // [sub][lane] bytes: scale in the low nibble, min in the high one
  static void unpack(const uint8_t* raw, uint8_t* levels, uint8_t* region, int lane) {
    put_half(region, 0, lane, raw + 80);
    put_half(region, 1, lane, raw + 82);
    for (int sub = 0; sub < 16; ++sub) region[kScaleAt + kTileLanes * sub + lane] = raw[sub];
    k_crumbs(raw + 16, levels);
  }
  static float weight(const uint8_t* region, int lane, int sub, int level) {
    const int packed = region[kScaleAt + kTileLanes * sub + lane];
    const float scale = half_at(half_item(region, 0, lane)) * static_cast<float>(packed & 15);
    const float offset = half_at(half_item(region, 1, lane)) * static_cast<float>(packed >> 4);
    return scale * static_cast<float>(level) - offset;
  }
};

struct Q3_K : Layout<256, 16, 2, 1, 4, 0, 110, 18> {
  static constexpr const char* kName = "Q3_K";
  static constexpr int kScaleAt = 32;  // [sub][lane] signed bytes, -32..31
  static void unpack(const uint8_t* raw, uint8_t* levels, uint8_t* region, int lane) {
    put_half(region, 0, lane, raw + 108);
    const uint8_t* packed = raw + 96;  // 4-bit low parts in nibbles of bytes 0-7, 2-bit high parts in bytes 8-11
    for (int sub = 0; sub < 16; ++sub) {
      const int low = (packed[sub % 8] >> (4 * (sub / 8))) & 15, high = (packed[8 + sub % 4] >> (2 * (sub / 4))) & 3;
      region[kScaleAt + kTileLanes * sub + lane] = static_cast<uint8_t>(static_cast<int8_t>((low | (high << 4)) - 32));
    }
    k_crumbs(raw + 32, levels);
    k_high_bits(raw, 2, levels);  // the file's high bit 1 means no offset: level = q + 4 with q in -4..3
  }
  static float weight(const uint8_t* region, int lane, int sub, int level) {
    const int8_t scale = static_cast<int8_t>(region[kScaleAt + kTileLanes * sub + lane]);
    return half_at(half_item(region, 0, lane)) * static_cast<float>(scale) * static_cast<float>(level - kZero);
  }
};

template <int HIGH, int FILE_BYTES>
struct QK_Mins : Layout<256, 32, 4, HIGH, 0, -1, FILE_BYTES, 20> {
  static constexpr int kScaleAt = 64, kMinAt = 192;  // [sub][lane] bytes, 0..63
  static void unpack_scales(const uint8_t* raw, uint8_t* region, int lane) {
    put_half(region, 0, lane, raw);
    put_half(region, 1, lane, raw + 2);
    uint8_t scales[8], mins[8];
    k_scales_and_mins(raw + 4, scales, mins);
    for (int sub = 0; sub < 8; ++sub)
      region[kScaleAt + kTileLanes * sub + lane] = scales[sub], region[kMinAt + kTileLanes * sub + lane] = mins[sub];
  }
  static float weight(const uint8_t* region, int lane, int sub, int level) {
    const float scale = half_at(half_item(region, 0, lane)) * static_cast<float>(region[kScaleAt + kTileLanes * sub + lane]);
    const float offset = half_at(half_item(region, 1, lane)) * static_cast<float>(region[kMinAt + kTileLanes * sub + lane]);
    return scale * static_cast<float>(level) - offset;
  }
};

struct Q4_K : QK_Mins<0, 144> {
  static constexpr const char* kName = "Q4_K";
  static void unpack(const uint8_t* raw, uint8_t* levels, uint8_t* region, int lane) {
    unpack_scales(raw, region, lane);
    k_nibbles(raw + 16, levels);
  }
};

struct Q5_K : QK_Mins<1, 176> {
  static constexpr const char* kName = "Q5_K";
  static void unpack(const uint8_t* raw, uint8_t* levels, uint8_t* region, int lane) {
    unpack_scales(raw, region, lane);
    k_nibbles(raw + 48, levels);
    k_high_bits(raw + 16, 4, levels);
  }
};

struct Q6_K : Layout<256, 16, 4, 2, 32, 0, 210, 18> {
  static constexpr const char* kName = "Q6_K";
  static constexpr int kScaleAt = 32;  // [sub][lane] signed bytes
  static void unpack(const uint8_t* raw, uint8_t* levels, uint8_t* region, int lane) {
    put_half(region, 0, lane, raw + 208);
    for (int sub = 0; sub < 16; ++sub) region[kScaleAt + kTileLanes * sub + lane] = raw[192 + sub];
    // Low nibbles: byte l of each 64 bytes h holds input 128h + l low and 128h + 64 + l high; top two bits: byte l
    // of each 32 bytes h holds, at bits 2s, input 128h + 32s + l.
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 64; ++l)
        levels[128 * h + l] = raw[64 * h + l] & 15, levels[128 * h + 64 + l] = raw[64 * h + l] >> 4;
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; ++l) levels[128 * h + 32 * s + l] |= ((raw[128 + 32 * h + l] >> (2 * s)) & 3) << 4;
  }
  static float weight(const uint8_t* region, int lane, int sub, int level) {
    const int8_t scale = static_cast<int8_t>(region[kScaleAt + kTileLanes * sub + lane]);
    const float scaled = half_at(half_item(region, 0, lane)) * static_cast<float>(scale);
    return scaled * static_cast<float>(level - kZero);
  }
};

// Calls f(Format{}) for the format `index` names in kFormatNames' order.
using Formats = std::tuple<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>;
constexpr int kFormatCount = std::tuple_size_v<Formats>;

template <typename F, size_t... I>
static auto with_format_at(int index, const F& f, std::index_sequence<I...>) {
  using Result = decltype(f(std::tuple_element_t<0, Formats>{}));
  if constexpr (std::is_void_v<Result>) {
    ((index == static_cast<int>(I) ? (f(std::tuple_element_t<I, Formats>{}), 0) : 0), ...);
  } else {
    Result result{};
    ((index == static_cast<int>(I) ? (result = f(std::tuple_element_t<I, Formats>{}), 0) : 0), ...);
    return result;
  }
}
template <typename F>
static auto with_format(int index, const F& f) {
  return with_format_at(index, f, std::make_index_sequence<kFormatCount>{});
}

template <size_t... I>
static constexpr bool lane_bytes_distinct(std::index_sequence<I...>) {
  constexpr int bytes[] = {std::tuple_element_t<I, Formats>::kLaneBytes...};
  for (size_t a = 0; a < sizeof...(I); ++a)
    for (size_t b = a + 1; b < sizeof...(I); ++b)
      if (bytes[a] == bytes[b]) return false;
  return true;
}
static_assert(lane_bytes_distinct(std::make_index_sequence<kFormatCount>{}),
              "a tile's bytes per lane and block must name its format");

static int format_named(const std::string& name) {
  int found = -1;
  for (int i = 0; i < kFormatCount; ++i)
    with_format(i, [&](auto format) { if (name == decltype(format)::kName) found = i; });
  TORCH_CHECK(found >= 0, "block tiles: no GGUF format named '", name, "'");
  return found;
}

// The format of block tiles, from their bytes per lane and block (is_block_tiles checked the rest of the shape).
static int format_of(const torch::Tensor& tiles) {
  int found = -1;
  for (int i = 0; i < kFormatCount; ++i)
    with_format(i, [&](auto format) { if (tiles.size(3) == decltype(format)::kLaneBytes) found = i; });
  TORCH_CHECK(found >= 0, "block tiles: ", tiles.size(3), " bytes per lane and block name no format");
  return found;
}

// ----- Packing and reading levels -----

// Level `input` of lane `lane` of a tile's block, and the same level written into a zeroed block.
template <class Format>
static inline int level_at(const uint8_t* block, int lane, int input) {
  constexpr int kLowPer = 8 / Format::kLowBits;
  const int quad = input / 4, byte = 4 * lane + input % 4;
  int level = (block[(quad / kLowPer) * kRegisterBytes + byte] >> ((quad % kLowPer) * Format::kLowBits)) &
              ((1 << Format::kLowBits) - 1);
  if constexpr (Format::kHighBits > 0) {
    constexpr int kHighPer = 8 / Format::kHighBits;
    const uint8_t* high = block + Format::kLowBytes;
    level |= ((high[(quad / kHighPer) * kRegisterBytes + byte] >> ((quad % kHighPer) * Format::kHighBits)) &
              ((1 << Format::kHighBits) - 1)) << Format::kLowBits;
  }
  return level;
}

template <class Format>
static inline void place_levels(const uint8_t* levels, uint8_t* block, int lane) {
  constexpr int kLowPer = 8 / Format::kLowBits;
  for (int input = 0; input < Format::kInputs; ++input) {
    const int quad = input / 4, byte = 4 * lane + input % 4;
    const int low = levels[input] & ((1 << Format::kLowBits) - 1);
    block[(quad / kLowPer) * kRegisterBytes + byte] |= static_cast<uint8_t>(low << ((quad % kLowPer) * Format::kLowBits));
    if constexpr (Format::kHighBits > 0) {
      constexpr int kHighPer = 8 / Format::kHighBits;
      uint8_t* high = block + Format::kLowBytes;
      high[(quad / kHighPer) * kRegisterBytes + byte] |=
          static_cast<uint8_t>((levels[input] >> Format::kLowBits) << ((quad % kHighPer) * Format::kHighBits));
    }
  }
}

// Tiles [tile_begin, tile_end) of the weight whose file rows are `raw` (row_bytes apart).
template <class Format>
static void pack_tiles(const uint8_t* raw, int64_t row_bytes, int64_t rows, int64_t blocks, uint8_t* tiles,
                       int64_t tile_begin, int64_t tile_end) {
  uint8_t levels[Format::kInputs];
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    uint8_t* tile = tiles + t * blocks * Format::kBlockBytes;
    std::memset(tile, 0, static_cast<size_t>(blocks * Format::kBlockBytes));
    for (int lane = 0; lane < kTileLanes && t * kTileLanes + lane < rows; ++lane) {
      const uint8_t* row = raw + (t * kTileLanes + lane) * row_bytes;
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* block = tile + b * Format::kBlockBytes;
        Format::unpack(row + b * Format::kFileBytes, levels, block + Format::kLevelBytes, lane);
        place_levels<Format>(levels, block, lane);
      }
    }
  }
}

// Output feature `row` of the tiles as float32 (K of them): each weight as gguf's dequantization computes it.
template <class Format>
static void read_row(const uint8_t* tiles, int64_t blocks, int64_t row, float* out) {
  const int lane = static_cast<int>(row % kTileLanes);
  const uint8_t* tile = tiles + row / kTileLanes * blocks * Format::kBlockBytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * Format::kBlockBytes;
    const uint8_t* region = block + Format::kLevelBytes;
    for (int input = 0; input < Format::kInputs; ++input)
      out[b * Format::kInputs + input] =
          Format::weight(region, lane, input / Format::kSub, level_at<Format>(block, lane, input));
  }
}

}  // namespace

// ----- The product -----

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PATCHBAY_BLOCK_TILES 1
namespace {

// Activations rounded to int8 per 32 inputs: levels [rows][K], and per row and 32 inputs the scale, per 16 and
// per 32 the levels' integer sum, and those sums times the scale.
struct QuantizedRows {
  const int8_t* levels;
  int64_t K;
  const float* scales;
  const int32_t* sums16;
  const int32_t* sums32;
  const float* scaled16;
  const float* scaled32;
};

static inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// One row: per 32 inputs, levels round(x * 127 / max|x|) (nearest even, as llama.cpp's AVX quantizer), the
// scale max|x| / 127, and the integer sums.
template <typename X>
static void quantize_row(const X* x, int64_t K, int8_t* levels, float* scales, int32_t* sums16, int32_t* sums32,
                         float* scaled16, float* scaled32) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < K / kActivationGroup; ++g) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(x + g * kActivationGroup + 8 * i);
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
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(levels + g * kActivationGroup),
                        _mm256_permutevar8x32_epi32(bytes, order));
    const float scale = largest / 127.0f;
    const int32_t first = sum_lanes(_mm256_add_epi32(rounded[0], rounded[1]));
    const int32_t second = sum_lanes(_mm256_add_epi32(rounded[2], rounded[3]));
    scales[g] = scale;
    sums16[2 * g] = first, sums16[2 * g + 1] = second, sums32[g] = first + second;
    scaled16[2 * g] = static_cast<float>(first) * scale, scaled16[2 * g + 1] = static_cast<float>(second) * scale;
    scaled32[g] = static_cast<float>(first + second) * scale;
  }
}

// Registers of 8 lanes (Ymm: half a tile) or 16 (Zmm: a whole tile), with the integer and float operations the
// kernel needs.  Loads take a tile's bytes for the register's first lane on.
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool kYmmVnni = true;
#else
constexpr bool kYmmVnni = false;
#endif

struct Ymm {
  using I = __m256i;
  using F = __m256;
  static constexpr int kLanes = 8;
  static constexpr bool kVnni = kYmmVnni;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  template <int S>
  static I shift16(I a) {  // left by S bits (right by -S) within 16-bit words
    if constexpr (S > 0) return _mm256_slli_epi16(a, S);
    else if constexpr (S < 0) return _mm256_srli_epi16(a, -S);
    else return a;
  }
  static I dot4(I sums, I levels, I activations) {  // VNNI: four u8 x s8 products into each int32
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(sums, levels, activations);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(sums, levels, activations);
#else
    (void)levels, (void)activations;
    return sums;
#endif
  }
  static I pairs(I levels, I activations) { return _mm256_maddubs_epi16(levels, activations); }
  static I abs8(I a) { return _mm256_abs_epi8(a); }
  static I sign8(I a, I b) { return _mm256_sign_epi8(a, b); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen16(I a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I unsigned8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I signed8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I low_bits(I a, int mask) { return _mm256_and_si256(a, _mm256_set1_epi32(mask)); }
  static I high_bits(I a, int shift) { return _mm256_srli_epi32(a, shift); }
  static void store(float* to, F a) { _mm256_storeu_ps(to, a); }
};

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PATCHBAY_BLOCK_TILES_ZMM 1
struct Zmm {
  using I = __m512i;
  using F = __m512;
  static constexpr int kLanes = 16;
  static constexpr bool kVnni = true;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I zero() { return _mm512_setzero_si512(); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  template <int S>
  static I shift16(I a) {
    if constexpr (S > 0) return _mm512_slli_epi16(a, S);
    else if constexpr (S < 0) return _mm512_srli_epi16(a, -S);
    else return a;
  }
  static I dot4(I sums, I levels, I activations) { return _mm512_dpbusd_epi32(sums, levels, activations); }
  static I pairs(I levels, I activations) { return _mm512_maddubs_epi16(levels, activations); }
  static I abs8(I a) { return _mm512_abs_epi8(a); }
  static I sign8(I a, I b) { return _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(b), _mm512_setzero_si512(), a); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I widen16(I a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I unsigned8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I signed8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I low_bits(I a, int mask) { return _mm512_and_si512(a, _mm512_set1_epi32(mask)); }
  static I high_bits(I a, int shift) { return _mm512_srli_epi32(a, shift); }
  static void store(float* to, F a) { _mm512_storeu_ps(to, a); }
};
#endif

// Per block and sub-block, the lanes' factors from a tile block's scale region, for the register whose first lane
// is `lane0`: the block's d (every format) and its second float16 (Q4_1's and Q5_1's m, the k-quants' dmin), and
// each sub-block's integer scale and min as floats (the k-quants; 1 for the others, which have none).
template <class Format, class V>
struct Factors {
  using F = typename V::F;
  static constexpr bool kSubScales = Format::kInputs == 256;
  static F d(const uint8_t* region, int lane0) { return V::halves(half_item(region, 0, lane0)); }
  static F second(const uint8_t* region, int lane0) { return V::halves(half_item(region, 1, lane0)); }
  static F scale(const uint8_t* region, int lane0, int sub) {
    const uint8_t* at = region + Format::kScaleAt + kTileLanes * sub + lane0;
    if constexpr (std::is_same_v<Format, Q2_K>) return V::cvt(V::low_bits(V::unsigned8(at), 15));
    else if constexpr (std::is_same_v<Format, Q3_K> || std::is_same_v<Format, Q6_K>) return V::cvt(V::signed8(at));
    else return V::cvt(V::unsigned8(at));
  }
  static F min(const uint8_t* region, int lane0, int sub) {
    if constexpr (std::is_same_v<Format, Q2_K>)
      return V::cvt(V::high_bits(V::unsigned8(region + Format::kScaleAt + kTileLanes * sub + lane0), 4));
    else
      return V::cvt(V::unsigned8(region + Format::kMinAt + kTileLanes * sub + lane0));
  }
};

// The levels of quad `Q` (of 8) of 32-input group `group` of a block, as bytes in each 32-bit lane, for the register
// whose first lane is `lane0`.
template <class Format, class V, int Q>
static inline typename V::I quad_levels(const uint8_t* block, int64_t group, int lane0) {
  using I = typename V::I;
  constexpr int kLow = Format::kLowBits, kLowPer = 8 / kLow;
  const uint8_t* lanes = block + 4 * lane0;
  I levels = V::load(lanes + (group * kLow + Q / kLowPer) * kRegisterBytes);
  if constexpr (kLow < 8) levels = V::and_(V::template shift16<-(Q % kLowPer) * kLow>(levels), V::bytes((1 << kLow) - 1));
  if constexpr (Format::kHighBits > 0) {
    constexpr int kHigh = Format::kHighBits, kHighPer = 8 / kHigh;
    const I high = V::load(lanes + Format::kLowBytes + (group * kHigh + Q / kHighPer) * kRegisterBytes);
    levels = V::or_(levels, V::and_(V::template shift16<kLow - (Q % kHighPer) * kHigh>(high),
                                    V::bytes(((1 << kHigh) - 1) << kLow)));
  }
  return levels;
}

template <typename F, int... Q>
static inline void each_quad(const F& f, std::integer_sequence<int, Q...>) {
  (f(std::integral_constant<int, Q>{}), ...);
}

// How far ahead of the block it multiplies each tile's stream asks for its bytes, into L2.  A tile of 2048 inputs
// is only 9-19 KiB, so a request past a tile's end goes as far into the tile the next block of tiles starts
// with: the streams that start there start warm.  On the development machine (AMD EPYC, 1 thread, weights
// streamed from memory) this read Q4_0 tiles ~1.7x as fast as asking 1.5 KiB ahead into L1 within the tile,
// and as fast per byte as the bfloat16 tiles; 6 KiB ahead, or into L1, measured no faster.
constexpr int64_t kPrefetchBytes = 3072;

// Rows [m0, m0 + ROWS) times TILES tiles from `panel` on, in registers of V::kLanes lanes.
template <class Format, class V, typename X, int ROWS, int TILES>
static void block_kernel(const QuantizedRows& x, int64_t m0, const uint8_t* panel, int64_t tile_bytes,
                         int64_t blocks, const float* bias, X* out, int64_t ldo, int64_t n0, int64_t N) {
  using I = typename V::I;
  using F = typename V::F;
  using Factor = Factors<Format, V>;
  constexpr int kPerTile = kTileLanes / V::kLanes;
  constexpr int P = TILES * kPerTile;  // registers across the block's tiles
  constexpr int kSubQuads = Format::kSub / 4;
  constexpr int kSubsPerGroup = kActivationGroup / Format::kSub;
  constexpr int kGroups = Format::kInputs / kActivationGroup;
  // Without VNNI the byte products add in pairs into int16s, which hold kWiden quads before they must widen.
  // Q8_0's levels (0..255) would overflow them, so there they multiply as signed bytes, level - 128, by sign.
  constexpr bool kSigned = Format::kLowBits == 8 && !V::kVnni;
  constexpr int kLargest = kSigned ? 128 : (1 << (Format::kLowBits + Format::kHighBits)) - 1;
  constexpr int kWiden = 32767 / (2 * kLargest * 127);
  static_assert(V::kVnni || kWiden >= 1);
  const int64_t groups_per_row = x.K / kActivationGroup;
  const int64_t ahead = std::max<int64_t>(1, (kPrefetchBytes + Format::kBlockBytes - 1) / Format::kBlockBytes);
  F acc[ROWS][P];
  for (int m = 0; m < ROWS; ++m)
    for (int p = 0; p < P; ++p) acc[m][p] = V::fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block[TILES];
    for (int t = 0; t < TILES; ++t) block[t] = panel + t * tile_bytes + b * Format::kBlockBytes;
    {
      const int64_t to = b + ahead < blocks ? b * Format::kBlockBytes + ahead * Format::kBlockBytes
                                            : TILES * tile_bytes + (b + ahead - blocks) * Format::kBlockBytes;
      for (int t = 0; t < TILES; ++t)
        for (int64_t line = 0; line < Format::kBlockBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(panel + t * tile_bytes + to + line), _MM_HINT_T1);
    }
    // The block's d, and its m (Q4_1, Q5_1) or dmin (k-quants), per register.
    F d[P], second[P];
    for (int p = 0; p < P; ++p) {
      const uint8_t* region = block[p / kPerTile] + Format::kLevelBytes;
      d[p] = Factor::d(region, (p % kPerTile) * V::kLanes);
      if constexpr (Format::kOffset != 0) second[p] = Factor::second(region, (p % kPerTile) * V::kLanes);
    }
    for (int64_t g = 0; g < kGroups; ++g) {
      const int64_t group = b * kGroups + g;  // of the row's activations
      I dots[ROWS][P], partial[ROWS][P];
      each_quad([&](auto quad) {
        constexpr int q = decltype(quad)::value;
        if constexpr (q % kSubQuads == 0)
          for (int m = 0; m < ROWS; ++m)
            for (int p = 0; p < P; ++p) dots[m][p] = V::zero(), partial[m][p] = V::zero();
        I levels[P];
        for (int p = 0; p < P; ++p)
          levels[p] = quad_levels<Format, V, q>(block[p / kPerTile], g, (p % kPerTile) * V::kLanes);
        for (int m = 0; m < ROWS; ++m) {
          int32_t four;
          std::memcpy(&four, x.levels + (m0 + m) * x.K + group * kActivationGroup + 4 * q, 4);
          const I activations = V::set1(four);
          for (int p = 0; p < P; ++p) {
            if constexpr (V::kVnni) {
              dots[m][p] = V::dot4(dots[m][p], levels[p], activations);
            } else if constexpr (kSigned) {
              const I weights = V::xor_(levels[p], V::bytes(0x80));
              partial[m][p] = V::add16(partial[m][p], V::pairs(V::abs8(weights), V::sign8(activations, weights)));
            } else {
              partial[m][p] = V::add16(partial[m][p], V::pairs(levels[p], activations));
            }
          }
        }
        if constexpr (!V::kVnni && ((q % kSubQuads) % kWiden == kWiden - 1 || q % kSubQuads == kSubQuads - 1))
          for (int m = 0; m < ROWS; ++m)
            for (int p = 0; p < P; ++p) dots[m][p] = V::add32(dots[m][p], V::widen16(partial[m][p])), partial[m][p] = V::zero();
        if constexpr (q % kSubQuads == kSubQuads - 1) {
          constexpr int kSubInGroup = q / kSubQuads;
          const int sub = static_cast<int>(g * kSubsPerGroup + kSubInGroup);  // within the block
          const int64_t row_sub = group * kSubsPerGroup + kSubInGroup;         // within the row
          // The sub-block's s and o (as the magnitude subtracted, or m added) per register.
          F scale[P], offset[P];
          for (int p = 0; p < P; ++p) {
            const uint8_t* region = block[p / kPerTile] + Format::kLevelBytes;
            const int lane0 = (p % kPerTile) * V::kLanes;
            if constexpr (Factor::kSubScales) {
              scale[p] = V::mul(d[p], Factor::scale(region, lane0, sub));
              if constexpr (Format::kOffset != 0) offset[p] = V::mul(second[p], Factor::min(region, lane0, sub));
            } else {
              scale[p] = d[p], offset[p] = second[p];
            }
          }
          for (int m = 0; m < ROWS; ++m) {
            const int64_t row = m0 + m;
            const F x_scale = V::fset1(x.scales[row * groups_per_row + group]);
            const int64_t at = row * groups_per_row * kSubsPerGroup + row_sub;
            const int32_t level_sum = Format::kSub == 16 ? x.sums16[at] : x.sums32[at];
            const F scaled_sum = V::fset1(Format::kSub == 16 ? x.scaled16[at] : x.scaled32[at]);
            for (int p = 0; p < P; ++p) {
              I sums = dots[m][p];
              if constexpr (Format::kZero != 0 && !kSigned) sums = V::sub32(sums, V::set1(Format::kZero * level_sum));
              acc[m][p] = V::fmadd(V::cvt(sums), V::mul(scale[p], x_scale), acc[m][p]);
              if constexpr (Format::kOffset > 0) acc[m][p] = V::fmadd(offset[p], scaled_sum, acc[m][p]);
              if constexpr (Format::kOffset < 0) acc[m][p] = V::fnmadd(offset[p], scaled_sum, acc[m][p]);
            }
          }
        }
      }, std::make_integer_sequence<int, 8>{});
    }
  }
  for (int p = 0; p < P; ++p) {
    const int64_t n = n0 + p * V::kLanes;
    const int64_t valid = std::min<int64_t>(V::kLanes, N - n);
    alignas(64) float lanes[16];
    for (int m = 0; m < ROWS; ++m) {
      V::store(lanes, acc[m][p]);
      for (int64_t j = 0; j < valid; ++j)
        out[(m0 + m) * ldo + n + j] = static_cast<X>(lanes[j] + (bias ? bias[n + j] : 0.0f));
    }
  }
}

}  // namespace
#endif

#if defined(PATCHBAY_BLOCK_TILES)
namespace {

// Blocks of up to kRows rows by up to kBlockTiles tiles, in 512-bit registers with AVX-512, else 256-bit ones.
// (One row in blocks of four tiles, more dot products beside each other's latency, measured no faster.)
// With AVX2 the blocks' registers spill, yet blocks of two rows by one tile measured slower (AMD EPYC, built
// without AVX-512: Q4_0 at one row 29 % slower, at 16 rows 2 % slower).
constexpr int kRows = 4;
constexpr int kBlockTiles = 2;
#if defined(PATCHBAY_BLOCK_TILES_ZMM)
using Wide = Zmm;
#else
using Wide = Ymm;
#endif

template <typename X>
using BlockKernel = void (*)(const QuantizedRows&, int64_t, const uint8_t*, int64_t, int64_t, const float*, X*, int64_t,
                             int64_t, int64_t);

template <class Format, typename X, int TILES>
struct KernelRows {
  static constexpr BlockKernel<X> by_rows[kRows] = {
      block_kernel<Format, Wide, X, 1, TILES>, block_kernel<Format, Wide, X, 2, TILES>,
      block_kernel<Format, Wide, X, 3, TILES>, block_kernel<Format, Wide, X, 4, TILES>};
};

// Every row times the tiles [tile_begin, tile_end).
template <class Format, typename X>
static void block_tile_range(const QuantizedRows& x, int64_t rows, const uint8_t* tiles, int64_t blocks,
                             const float* bias, X* out, int64_t N, int64_t tile_begin, int64_t tile_end) {
  static constexpr const BlockKernel<X>* by_tiles[kBlockTiles] = {KernelRows<Format, X, 1>::by_rows,
                                                                  KernelRows<Format, X, 2>::by_rows};
  const int64_t tile_bytes = blocks * Format::kBlockBytes;
  for (int64_t t0 = tile_begin; t0 < tile_end; t0 += kBlockTiles) {
    const BlockKernel<X>* kernels = by_tiles[std::min<int64_t>(kBlockTiles, tile_end - t0) - 1];
    for (int64_t m0 = 0; m0 < rows; m0 += kRows)
      kernels[std::min<int64_t>(kRows, rows - m0) - 1](x, m0, tiles + t0 * tile_bytes, tile_bytes, blocks, bias, out, N,
                                                       t0 * kTileLanes, N);
  }
}

// Every row of x rounded to int8 (quantize_row), rows shared over the pool's threads when there are many.
// per_group: scales [rows][groups], scaled32 [rows][groups], scaled16 [rows][2 groups]; sums: sums16
// [rows][2 groups], sums32 [rows][groups].
template <typename X>
static void quantize_rows(const X* x, int64_t ldx, int64_t rows, int64_t K, int8_t* levels, float* per_group,
                          int32_t* sums, int64_t threads) {
  const int64_t groups = K / kActivationGroup;
  constexpr int64_t kRowsPerChunk = 8;
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  ChunkPool::instance().run(rows >= 2 * kRowsPerChunk ? static_cast<int>(threads) : 1, chunks, [&](int64_t chunk) {
    for (int64_t m = chunk * kRowsPerChunk; m < std::min(rows, (chunk + 1) * kRowsPerChunk); ++m)
      quantize_row(x + m * ldx, K, levels + m * K, per_group + m * groups, sums + 2 * m * groups,
                   sums + 2 * rows * groups + m * groups, per_group + 2 * rows * groups + 2 * m * groups,
                   per_group + rows * groups + m * groups);
  });
}

}  // namespace
#endif

namespace {

void check_block_tiles(const torch::Tensor& tiles, const char* what) {
  TORCH_CHECK(is_block_tiles(tiles), what, ": block tiles are contiguous uint8 [tiles][blocks][16][bytes per lane]");
}

}  // namespace

bool is_block_tiles(const torch::Tensor& tiles) {
  return tiles.scalar_type() == torch::kUInt8 && tiles.dim() == 4 && tiles.size(2) == kTileLanes &&
         tiles.is_contiguous();
}

torch::Tensor block_tiles_linear(torch::Tensor x, torch::Tensor tiles, c10::optional<torch::Tensor> bias,
                                 int64_t out_features, int64_t threads) {
#if defined(PATCHBAY_BLOCK_TILES)
  check_block_tiles(tiles, "block_tiles_linear");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "block_tiles_linear takes rows of contiguous features");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "block_tiles_linear takes float32 or bfloat16 activations, not ", x.scalar_type());
  const int format = format_of(tiles);
  const int64_t rows = x.size(0), K = x.size(1), N = out_features, n_tiles = tiles.size(0), blocks = tiles.size(1);
  const int64_t block_inputs = with_format(format, [](auto f) { return int64_t{decltype(f)::kInputs}; });
  TORCH_CHECK(K == blocks * block_inputs, "block_tiles_linear: the activations have ", K, " features, the tiles ",
              blocks * block_inputs);
  TORCH_CHECK(N > (n_tiles - 1) * kTileLanes && N <= n_tiles * kTileLanes, "block_tiles_linear: ", n_tiles,
              " tiles hold ", (n_tiles - 1) * kTileLanes + 1, " to ", n_tiles * kTileLanes, " output features, not ", N);
  TORCH_CHECK(threads >= 1, "block_tiles_linear: threads must be at least 1");
  auto out = torch::empty({rows, N}, x.options());
  if (rows == 0) return out;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "block_tiles_linear: a bias of ", bias->numel(), " values for ", N, " features");
    b = bias->contiguous().to(torch::kFloat32);
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t groups = K / kActivationGroup;
  auto levels = torch::empty({rows, K}, x.options().dtype(torch::kInt8));
  auto per_group = torch::empty({4 * rows * groups}, x.options().dtype(torch::kFloat32));
  auto sums = torch::empty({3 * rows * groups}, x.options().dtype(torch::kInt32));
  float* pg = per_group.data_ptr<float>();
  int32_t* sp = sums.data_ptr<int32_t>();
  if (x.scalar_type() == torch::kFloat32)
    quantize_rows(x.data_ptr<float>(), x.stride(0), rows, K, levels.data_ptr<int8_t>(), pg, sp, threads);
  else
    quantize_rows(x.data_ptr<at::BFloat16>(), x.stride(0), rows, K, levels.data_ptr<int8_t>(), pg, sp, threads);
  const QuantizedRows quantized{levels.data_ptr<int8_t>(), K,  pg, sp, sp + 2 * rows * groups,
                                pg + 2 * rows * groups,     pg + rows * groups};
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const int64_t per_chunk = chunk_tiles(n_tiles, kBlockTiles, threads);
  const int64_t chunks = (n_tiles + per_chunk - 1) / per_chunk;
  with_format(format, [&](auto f) {
    using Format = decltype(f);
    auto run = [&](auto* op) {
      ChunkPool::instance().run(static_cast<int>(threads), chunks, [&](int64_t chunk) {
        block_tile_range<Format>(quantized, rows, tp, blocks, bp, op, N, chunk * per_chunk,
                                 std::min(n_tiles, (chunk + 1) * per_chunk));
      }, weights_of(tiles));
    };
    if (x.scalar_type() == torch::kFloat32)
      run(out.data_ptr<float>());
    else
      run(out.data_ptr<at::BFloat16>());
  });
  return out;
#else
  TORCH_CHECK(false, "block_tiles_linear needs AVX2 with FMA and F16C");
#endif
}

namespace {

// raw: the file's blocks, uint8 [out_features, row bytes] (any strides between rows, contiguous within one);
// returns the tiles, uint8 [ceil(out_features / 8)][blocks][8][bytes per lane].
torch::Tensor block_tiles_pack(torch::Tensor raw, const std::string& format_name, int64_t out_features,
                               int64_t in_features, int64_t threads) {
  const int format = format_named(format_name);
  return with_format(format, [&](auto f) {
    using Format = decltype(f);
    TORCH_CHECK(in_features > 0 && in_features % Format::kInputs == 0, "block_tiles_pack: ", Format::kName,
                " blocks hold ", Format::kInputs, " inputs, and ", in_features, " is no multiple of that");
    const int64_t blocks = in_features / Format::kInputs, row_bytes = blocks * Format::kFileBytes;
    TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.size(0) == out_features &&
                    raw.size(1) == row_bytes && raw.stride(1) == 1,
                "block_tiles_pack: ", Format::kName, " rows of ", in_features, " inputs are uint8 [", out_features,
                ", ", row_bytes, "], got ", raw.scalar_type(), " ", raw.sizes());
    const int64_t n_tiles = (out_features + kTileLanes - 1) / kTileLanes;
    torch::Tensor tiles = torch::empty({n_tiles, blocks, kTileLanes, Format::kLaneBytes}, raw.options());
    const uint8_t* rp = raw.data_ptr<uint8_t>();
    uint8_t* tp = tiles.data_ptr<uint8_t>();
    const int64_t per_chunk = chunk_tiles(n_tiles, 1, threads);
    ChunkPool::instance().run(static_cast<int>(threads), (n_tiles + per_chunk - 1) / per_chunk, [&](int64_t chunk) {
      pack_tiles<Format>(rp, raw.stride(0), out_features, blocks, tp, chunk * per_chunk,
                         std::min(n_tiles, (chunk + 1) * per_chunk));
    });
    return tiles;
  });
}

// Output features `rows` (int64) of the tiles as float32 [len(rows), K], each weight as gguf dequantizes it.
torch::Tensor block_tiles_rows(torch::Tensor tiles, torch::Tensor rows, int64_t out_features, int64_t threads) {
  check_block_tiles(tiles, "block_tiles_rows");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.dim() == 1, "block_tiles_rows: rows are int64 [n]");
  const auto ids = rows.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t count = ids.size(0), blocks = tiles.size(1);
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < out_features, "block_tiles_rows: row ", ip[i], " of ", out_features);
  const int format = format_of(tiles);
  const int64_t K = blocks * with_format(format, [](auto f) { return int64_t{decltype(f)::kInputs}; });
  auto out = torch::empty({count, K}, tiles.options().dtype(torch::kFloat32));
  float* op = out.data_ptr<float>();
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  constexpr int64_t kRowsPerChunk = 16;
  with_format(format, [&](auto f) {
    using Format = decltype(f);
    ChunkPool::instance().run(count >= 2 * kRowsPerChunk ? static_cast<int>(threads) : 1,
                              (count + kRowsPerChunk - 1) / kRowsPerChunk, [&](int64_t chunk) {
      for (int64_t i = chunk * kRowsPerChunk; i < std::min(count, (chunk + 1) * kRowsPerChunk); ++i)
        read_row<Format>(tp, blocks, ip[i], op + i * K);
    });
  });
  return out;
}

// The formats, in order: (name, inputs per block, bytes per block in the file, bytes per lane and block in tiles).
std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> block_tile_formats() {
  std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> formats;
  for (int i = 0; i < kFormatCount; ++i)
    with_format(i, [&](auto f) {
      using Format = decltype(f);
      formats.emplace_back(Format::kName, Format::kInputs, Format::kFileBytes, Format::kLaneBytes);
    });
  return formats;
}

// Which product kernel this build runs ("" where it has none).
std::string block_tiles_kernel() {
#if defined(PATCHBAY_BLOCK_TILES_ZMM)
  return "avx512-vnni";
#elif defined(PATCHBAY_BLOCK_TILES)
  return kYmmVnni ? "avx2-vnni" : "avx2";
#else
  return "";
#endif
}

}  // namespace

void bind_block_tiles(pybind11::module& m) {
  m.def("block_tiles_linear", torch::wrap_pybind_function_no_gil(block_tiles_linear), "block_tiles_linear");
  m.def("block_tiles_pack", torch::wrap_pybind_function_no_gil(block_tiles_pack), "block_tiles_pack");
  m.def("block_tiles_rows", torch::wrap_pybind_function_no_gil(block_tiles_rows), "block_tiles_rows");
  m.def("block_tile_formats", &block_tile_formats, "block_tile_formats");
  m.def("block_tiles_kernel", &block_tiles_kernel, "block_tiles_kernel");
}
