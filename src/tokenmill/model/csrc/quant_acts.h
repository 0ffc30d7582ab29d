#pragma once
// Activations rounded to int8 for the VNNI kernels (quant_vnni.h), in one or two terms per value.
//
// Why a file of its own: the rounding is the same for every weight format and every kernel shape
// (the column-blocked linear, the fused decode step), so it sits apart from the loops that consume
// it. quant_vnni.h explains the two-term scheme and what it costs in quality.

#include <immintrin.h>

#include "quant_amx8_acts.h"
#include "quant_amx_acts.h"
#include "quant_blocks.h"

#include <cmath>
#include <cstdint>

namespace tm_vnni {
namespace {
// Quantized activations, group-major so that a tile's rows of one group sit at constant offsets
// from one pointer (a row-major layout needed a pointer per row and term: spilled registers).
struct Acts {
  int8_t* xq;        // [G, M, terms, 32] rounded activations (term 2: the residual of term 1)
  float* dx;         // [G, M, terms] scale per group and term
  float* qsum;       // [G, M] sum over terms of dx * sum of the group's rounded values (min term)
  // [G, M, 3] the rounded values' sums over the group, its first half and its second half (16 inputs
  // each), the terms merged as the kernels merge their dot products (256 S1 + S2 with two terms): a
  // code offset k costs a dot product -k * msum, which a tile starts its last term's sum from.
  int32_t* msum;
  float* hqsum;      // [G, M, 2] qsum of each half (the min term of sub-blocks of 16)
  int64_t M;
  // The same rows as two bf16 terms for the AMX tiles, where a fused step of enough rows on a CPU
  // with them has them (decode_kits.h rounds both); empty otherwise.
  tm_amx::SplitActs split{};
  // The same rows as two int8 terms per 256 inputs for the AMX-INT8 tiles, where a fused step of a
  // few dozen rows on a CPU with them has them (quant_amx8.h); empty otherwise.
  tm_amx8::Acts8 amx8{};
  // Whether the int8 terms above are rounded at all: not where the split serves every reader (a
  // fused step's linears over all its rows; a MoE layer's experts gather int8 rows).
  bool int8 = true;
};

// Ints of msum per group and row.
constexpr int64_t kMergedSums = 3;

// Where the numbers of one group and row go.
struct GroupOut {
  int8_t* xq;
  float* dx;
  float* qsum;
  int32_t* msum;
  float* hqsum;
};

// The second term's step is 1/256 of the first's (a power of two: exact in fp32), not a scale of its
// own: the residual of the first term is within half its step, so it rounds to [-128, 128] steps of
// 1/256, and 128 saturates to 127 (an error of at most one fine step, 1/256 of the first term's,
// where a scale of its own would leave half of ~1/254). In exchange the kernels merge a row's two
// int32 sums as 256 D1 + D2 in integers and scale once (quant_vnni.h).
constexpr float kFineSteps = 256.f;

TV_TARGET TV_INLINE __m512i clamp_i8(__m512i q) {
  return _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-128)), _mm512_set1_epi32(127));
}

// One more term's sums of a group (all of it, and its first half) merged into msum's three values, as
// the tiles merge their terms' dot products: the earlier terms' sums move up by the fine steps.
TV_INLINE void merge_term_sums(int32_t* merged, int32_t total, int32_t first) {
  const int32_t steps = static_cast<int32_t>(kFineSteps);
  merged[0] = merged[0] * steps + total;
  merged[1] = merged[1] * steps + first;
  merged[2] = merged[2] * steps + (total - first);
}

// One group (32 values in lo, hi) rounded to `terms` int8 terms: the reference for quantize4.
TV_TARGET TV_INLINE void quantize1(__m512 lo, __m512 hi, int terms, const GroupOut& o) {
  float total_sum = 0.f, half_sum[2] = {0.f, 0.f};
  int32_t merged[kMergedSums] = {0, 0, 0};
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  float inv_s = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
  for (int t = 0; t < terms; ++t) {
    if (t > 0) {
      inv_s *= kFineSteps;
      scale /= kFineSteps;
    }
    const __m512 inv = _mm512_set1_ps(inv_s);
    __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
    __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    if (t > 0) {
      qlo = clamp_i8(qlo);
      qhi = clamp_i8(qhi);
    }
    const int32_t first = _mm512_reduce_add_epi32(qlo), second = _mm512_reduce_add_epi32(qhi);
    const int32_t total = first + second;
    o.dx[t] = scale;
    total_sum = std::fma(scale, static_cast<float>(total), total_sum);
    half_sum[0] = std::fma(scale, static_cast<float>(first), half_sum[0]);
    half_sum[1] = std::fma(scale, static_cast<float>(second), half_sum[1]);
    merge_term_sums(merged, total, first);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o.xq + t * kGroup), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o.xq + t * kGroup + 16), _mm512_cvtsepi32_epi8(qhi));
    // what this term left out, for the next one
    const __m512 s = _mm512_set1_ps(scale);
    lo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo), s, lo);
    hi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi), s, hi);
  }
  *o.qsum = total_sum;
  for (int i = 0; i < kMergedSums; ++i) o.msum[i] = merged[i];
  o.hqsum[0] = half_sum[0];
  o.hqsum[1] = half_sum[1];
}

// Reductions of 4 vectors at once: 128-bit chunk i of the result holds the reduction of v[i] in all 4
// lanes (11 shuffles and ops for 4 groups, against 4 x 6 one group at a time).
TV_TARGET TV_INLINE __m512 max4(const __m512 (&v)[4]) {
  const __m512 x01 = _mm512_max_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 x23 = _mm512_max_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  __m512 y = _mm512_max_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
  y = _mm512_max_ps(y, _mm512_permute_ps(y, 0x4E));
  return _mm512_max_ps(y, _mm512_permute_ps(y, 0xB1));
}

TV_TARGET TV_INLINE __m512i sum4(const __m512i (&v)[4]) {
  const __m512i x01 = _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], 0x44), _mm512_shuffle_i32x4(v[0], v[1], 0xEE));
  const __m512i x23 = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2], v[3], 0x44), _mm512_shuffle_i32x4(v[2], v[3], 0xEE));
  __m512i y = _mm512_add_epi32(_mm512_shuffle_i32x4(x01, x23, 0x88), _mm512_shuffle_i32x4(x01, x23, 0xDD));
  y = _mm512_add_epi32(y, _mm512_shuffle_epi32(y, _MM_PERM_BADC));
  return _mm512_add_epi32(y, _mm512_shuffle_epi32(y, _MM_PERM_CDAB));
}

template <int I>
TV_TARGET TV_INLINE __m512 chunk(__m512 v) { return _mm512_shuffle_f32x4(v, v, I * 0x55); }

// Four consecutive groups of one row at once, the same numbers as quantize1: one group alone is a
// chain of reductions, divisions and conversions (~25 ns a group and row, 55 us for K = 1536 x 48
// rows; four at a time ~13 ns). Outputs: group i's record is `stride` records on.
template <int Terms>
TV_TARGET TV_INLINE void quantize4(const float* src, const GroupOut& o, int64_t stride) {
  __m512 lo[4], hi[4];
  for (int i = 0; i < 4; ++i) {
    lo[i] = _mm512_loadu_ps(src + i * kGroup);
    hi[i] = _mm512_loadu_ps(src + i * kGroup + 16);
  }
  __m512 total_sum = _mm512_setzero_ps(), first_sum = _mm512_setzero_ps(), second_sum = _mm512_setzero_ps();
  alignas(64) float scales[Terms][16];
  alignas(64) int32_t firsts[Terms][16], totals[Terms][16];
  __m512 m[4];
  for (int i = 0; i < 4; ++i) m[i] = _mm512_max_ps(_mm512_abs_ps(lo[i]), _mm512_abs_ps(hi[i]));
  const __m512 amax = max4(m);
  const __mmask16 nonzero = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
  __m512 inv = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(127.f), amax);
  __m512 scale = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
  for (int t = 0; t < Terms; ++t) {
    if (t > 0) {  // the residual on steps of 1/256 of the first term's (quantize1)
      inv = _mm512_mul_ps(inv, _mm512_set1_ps(kFineSteps));
      scale = _mm512_div_ps(scale, _mm512_set1_ps(kFineSteps));
    }
    __m512i qlo[4], qhi[4], s[4];
    __m512 inv_i[4] = {chunk<0>(inv), chunk<1>(inv), chunk<2>(inv), chunk<3>(inv)};
    __m512 sc_i[4] = {chunk<0>(scale), chunk<1>(scale), chunk<2>(scale), chunk<3>(scale)};
    for (int i = 0; i < 4; ++i) {
      qlo[i] = _mm512_cvtps_epi32(_mm512_mul_ps(lo[i], inv_i[i]));
      qhi[i] = _mm512_cvtps_epi32(_mm512_mul_ps(hi[i], inv_i[i]));
      if (t > 0) {
        qlo[i] = clamp_i8(qlo[i]);
        qhi[i] = clamp_i8(qhi[i]);
      }
      s[i] = _mm512_add_epi32(qlo[i], qhi[i]);
      int8_t* dst = o.xq + (i * stride * Terms + t) * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo[i]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi[i]));
      lo[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo[i]), sc_i[i], lo[i]);
      hi[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi[i]), sc_i[i], hi[i]);
    }
    const __m512i total = sum4(s), first = sum4(qlo);
    total_sum = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(total), total_sum);
    first_sum = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(first), first_sum);
    second_sum = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(total, first)), second_sum);
    _mm512_store_ps(scales[t], scale);
    _mm512_store_si512(totals[t], total);
    _mm512_store_si512(firsts[t], first);
  }
  alignas(64) float sums[3][16];
  _mm512_store_ps(sums[0], total_sum);
  _mm512_store_ps(sums[1], first_sum);
  _mm512_store_ps(sums[2], second_sum);
  for (int i = 0; i < 4; ++i) {
    int32_t* merged = o.msum + i * stride * kMergedSums;
    merged[0] = merged[1] = merged[2] = 0;
    for (int t = 0; t < Terms; ++t) {
      o.dx[i * stride * Terms + t] = scales[t][4 * i];
      merge_term_sums(merged, totals[t][4 * i], firsts[t][4 * i]);
    }
    o.qsum[i * stride] = sums[0][4 * i];
    o.hqsum[2 * i * stride] = sums[1][4 * i];
    o.hqsum[2 * i * stride + 1] = sums[2][4 * i];
  }
}

// Rows m0..m1 of x [M, K] into the group-major layout of Acts.
template <int Terms>
TV_TARGET void quantize_rows(const float* x, int64_t K, int64_t m0, int64_t m1, const Acts& a) {
  const int64_t G = K / kGroup, M = a.M;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t g = 0; g < G;) {
      const int64_t at = g * M + m;  // record of (g, m); the next group's is M records on
      const GroupOut o{a.xq + at * Terms * kGroup, a.dx + at * Terms, a.qsum + at, a.msum + at * kMergedSums,
                       a.hqsum + at * 2};
      if (g + 4 <= G) {
        quantize4<Terms>(x + m * K + g * kGroup, o, M);
        g += 4;
      } else {
        quantize1(_mm512_loadu_ps(x + m * K + g * kGroup), _mm512_loadu_ps(x + m * K + g * kGroup + 16), Terms, o);
        g += 1;
      }
    }
  }
}

// Floats of scratch that M rows of K activations take once rounded, in `terms` int8 terms.
inline int64_t acts_floats(int64_t M, int64_t K, int64_t terms) {
  const int64_t groups = M * (K / kGroup);
  return groups * (terms + 3 + kMergedSums) + (M * terms * K + 3) / 4;
}

// The Acts of M rows of K activations laid out in `base` (acts_floats(M, K, terms) floats).
inline Acts make_acts(float* base, int64_t M, int64_t K, int64_t terms) {
  const int64_t groups = M * (K / kGroup);
  float* dx = base;
  float* qsum = dx + groups * terms;
  float* hqsum = qsum + groups;
  int32_t* msum = reinterpret_cast<int32_t*>(hqsum + 2 * groups);
  int8_t* xq = reinterpret_cast<int8_t*>(msum + kMergedSums * groups);
  return Acts{xq, dx, qsum, msum, hqsum, M};
}

}  // namespace
}  // namespace tm_vnni
