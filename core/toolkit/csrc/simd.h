// C++ shared by patchbay's kernels: a float register type over AVX-512 or AVX2 (PATCHBAY_SIMD is defined
// where one of them is available) with float32 and bfloat16 loads and stores and a vectorized exponential.
#pragma once
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
// a's lanes as bfloat16 bits, rounded to nearest even as torch rounds them (NaNs stay quiet NaNs).
static inline __m256i vbf16_bits(vfloat a) {
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
  const __m512i kept = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), quiet);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(kept, 16));
}
static inline void vstore(float* p, vfloat a) { _mm512_storeu_ps(p, a); }
static inline void vstore(c10::BFloat16* p, vfloat a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), vbf16_bits(a));
}
// The first `count` of 16 lanes (all of them from 16 on), for loads and stores at the end of a row.
static inline __mmask16 vmask_first(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}
static inline vfloat vload_masked(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
static inline vfloat vload_masked(const c10::BFloat16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
static inline void vstore_masked(float* p, vfloat a, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, a); }
static inline void vstore_masked(c10::BFloat16* p, vfloat a, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, vbf16_bits(a));
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
// Eight floats from float32 or bfloat16 (widened exactly), whatever the register width above.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
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
