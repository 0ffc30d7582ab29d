#pragma once
// The AVX2 kernel's activations (quant_avx2.h explains the kernel).
//
// Why a file of its own: the rounding of a row into the records the kernel multiplies is one concept,
// read and checked against quant_acts.h's (the same Acts numbers, terms merged), apart from the
// codes' unpacking and the product.
//
// The numbers are quant_acts.h's rounding (the same Acts numbers), each value's terms stored merged as
// one int16, 256 q1 + q2 (q1 alone with one term): the records are always laid out for two terms
// (64 bytes a group and row), and dx[Terms - 1] is the merged value's unit. The second term is
// clamped to [-127, 127] as the first is (quant_acts.h lets it reach -128): |256 q1 + q2| <= 32639.

#include <immintrin.h>

#include "quant_acts.h"

#include <cmath>
#include <cstdint>

#define T2_TARGET __attribute__((target("avx2,fma,f16c")))
#define T2_INLINE inline __attribute__((always_inline))

namespace tm_avx2 {

using tm_vnni::kGroup;
using tm_vnni::kMergedSums;

T2_TARGET T2_INLINE float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

T2_TARGET T2_INLINE int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

constexpr int kLayoutTerms = 2;  // the Acts layout the AVX2 ops allocate, whatever the terms

template <int Terms>
T2_TARGET void round_group(const float* src, const tm_vnni::GroupOut& o) {
  __m256 v[4];
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs_mask));
  }
  const float amax = hmax(m);
  float inv_s = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
  float total_sum = 0.f, half_sum[2] = {0.f, 0.f};
  int32_t merged[kMergedSums] = {0, 0, 0};
  __m256i x16[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int t = 0; t < Terms; ++t) {
    if (t > 0) {
      inv_s *= tm_vnni::kFineSteps;
      scale /= tm_vnni::kFineSteps;
    }
    const __m256 inv = _mm256_set1_ps(inv_s), s = _mm256_set1_ps(scale);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      if (t > 0) q[i] = _mm256_min_epi32(_mm256_max_epi32(q[i], _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
      x16[i] = _mm256_add_epi32(_mm256_slli_epi32(x16[i], 8), q[i]);
      v[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[i]), s, v[i]);
    }
    const int32_t first = hsum(_mm256_add_epi32(q[0], q[1])), total = first + hsum(_mm256_add_epi32(q[2], q[3]));
    o.dx[t] = scale;
    total_sum = std::fma(scale, static_cast<float>(total), total_sum);
    half_sum[0] = std::fma(scale, static_cast<float>(first), half_sum[0]);
    half_sum[1] = std::fma(scale, static_cast<float>(total - first), half_sum[1]);
    tm_vnni::merge_term_sums(merged, total, first);
  }
  int16_t* dst = reinterpret_cast<int16_t*>(o.xq);
  for (int i = 0; i < 2; ++i) {  // 16 int32 (within int16) -> 16 int16, in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(x16[2 * i], x16[2 * i + 1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * i), packed);
  }
  *o.qsum = total_sum;
  for (int i = 0; i < kMergedSums; ++i) o.msum[i] = merged[i];
  o.hqsum[0] = half_sum[0];
  o.hqsum[1] = half_sum[1];
}

// Groups [g0, g1) of row m rounded into a (x: the row's values from group g0 on).
template <int Terms>
T2_TARGET void round_span(const float* x, int64_t g0, int64_t g1, int64_t m, const tm_vnni::Acts& a) {
  const int64_t M = a.M;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t at = g * M + m;
    round_group<Terms>(x + (g - g0) * kGroup,
                       tm_vnni::GroupOut{a.xq + at * kLayoutTerms * kGroup, a.dx + at * kLayoutTerms, a.qsum + at,
                                         a.msum + at * kMergedSums, a.hqsum + at * 2});
  }
}

template <int Terms>
T2_TARGET void round_rows(const float* x, int64_t K, int64_t m0, int64_t m1, const tm_vnni::Acts& a) {
  for (int64_t m = m0; m < m1; ++m) round_span<Terms>(x + m * K, 0, K / kGroup, m, a);
}

}  // namespace tm_avx2
