// Shared vector helpers of the fused CPU kernels (see kernels.h): 8-lane loads and stores of
// float32 and bfloat16, a zero-padded tail through the same vector code, a fixed-order lane sum,
// a row's maximum, exp; their 16-lane AVX-512 twins. Each ``static inline``: every translation
// unit has its own copy, compiled with the same flags (-ffp-contract=off: only the FMAs written
// here are fused), so the arithmetic is the same wherever it is inlined.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace specdraft {

using BF16 = at::BFloat16;

// Functions compiled for AVX-512 as well as the AVX2 baseline, used where the processor has it
// (``has_avx512``). The packed GEMM's are bit-identical to their AVX2 versions (the same FMA
// chains, 16 lanes at a time); the attention's sum a score's 16-lane partial sums in another
// order than its 8-lane ones — either way the same on every row and call of one machine.
#define SPECDRAFT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// Whether the AVX-512 variants run (features.cpp).
bool has_avx512();

// ---- 8-lane loads and stores -------------------------------------------------------------

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

static inline __m256 load8(const BF16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// c10::BFloat16's rounding (round to nearest even, NaN -> 0x7FC0), eight lanes at once.
static inline void store8(BF16* p, __m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// A tail of k < 8 elements through the same vector code: copied into a zeroed block.
template <typename T>
static inline __m256 load_tail(const T* p, int64_t k) {
  alignas(32) T block[8] = {};
  for (int64_t i = 0; i < k; ++i) block[i] = p[i];
  return load8(block);
}

template <typename T>
static inline void store_tail(T* p, __m256 v, int64_t k) {
  alignas(32) T block[8];
  store8(block, v);
  for (int64_t i = 0; i < k; ++i) p[i] = block[i];
}

// The sum of a vector's lanes in one fixed order.
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of w[0 .. count), 8 lanes at a time (a max is exact: any order gives its bits).
static inline float max_of(const float* w, int64_t count) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t p = 0;
  for (; p + 8 <= count; p += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(w + p));
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xb1));
  float top = _mm256_cvtss_f32(m);
  for (; p < count; ++p) top = std::max(top, w[p]);
  return top;
}

// exp(x) per lane: Cephes' range reduction and polynomial (about 1 ulp); exp(x) = 0 below -88.37.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// exp8's arithmetic, 16 lanes at a time.
static SPECDRAFT_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

// 16 lanes from float32 or bfloat16 (widened exactly).
static SPECDRAFT_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

static SPECDRAFT_AVX512 inline __m512 load16(const BF16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

}  // namespace specdraft
