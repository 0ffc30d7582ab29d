#pragma once
// Weights as the AMX-BF16 tiles take them (quant_amx.h): what each format's tiles multiply (folded
// sub-block scales, planes of B, activation terms) and its blocks decoded into AMX's B layout by the
// VNNI kernel's block decoders (quant_blocks.h), with their scales and mins per unit.
//
// Why a file of its own: the tiles (quant_amx.h) run every format through one skeleton; what differs
// per format is here, beside the activations' side of the same layout (quant_amx_acts.h).

#include <immintrin.h>

#include "amx_tiles.h"
#include "quant_blocks.h"

#include <cstdint>

namespace tm_amx {

using tm_vnni::kCols;
using tm_vnni::Weights;

// Formats whose integer sub-block scales fold into B exactly, so that a super-block's 8 groups sum in
// one tile under its one d (one store and scaling per 256 inputs instead of per 16): Q3_K's (code -
// 4) x scale is within 4 x 32 = 128, which bf16 holds. Q2_K (mins per 16 inputs) and Q4_K / Q5_K
// (products with a min) do not.
template <class D>
constexpr bool kFolds = D::kFmt == tm_vnni::kQ3K;

// Formats whose whole scale (Q6_K: d x its int8 sub-block scale) is multiplied into B, each weight as
// two bf16 planes (kPlanes: hi = bf16(w), then what bf16 left: ~16 bits, w's error under 2^-16 of
// it, where bf16(x) rounds the activations by up to 2^-8): the tiles sum a whole span of the inputs
// (up to 48 groups) with no store or scaling between its super-blocks. Why: a tile stored and scaled
// every super-block waits for its products each time; measured (`/work/scratch/s34/fold_speed.py`,
// both alternating in one process, best of 21 rounds, 2 threads), Q6_K 576 x 1,536 at 512 rows 1.39
// -> 1.17 ms, at 128 rows 0.43 -> 0.39. Not Q8_0: one plane of exact codes becomes two, decoded a
// call, and its 512-row tiles gained nothing on two threads (0.98-1.02x) while 64-128 rows lost
// (0.58-0.87x).
template <class D>
constexpr bool kFoldsScale = D::kFmt == tm_vnni::kQ6K;
template <class D>
constexpr int kPlanes = kFoldsScale<D> ? 2 : 1;

// Activation terms a format's tiles multiply: Q8_0 and Q6_K take hi = bf16(x) alone (one product a
// unit and plane instead of two, and half the A tiles loaded), the others hi and lo; a caller may ask
// for two whatever the format (`two_terms`: the lm_head, whose sums are the logits). Measured with
// `tokenmill bench quality --mode prefill` (fast against exact, 1,785 positions; docs/benchmarks.md,
// "Q8_0 and Q6_K prompts on one activation term"): with these two on one term (the lm_head on two)
// every mix keeps top-1 >= 99 % (the Q6_K mix 99.66 -> 99.05 %, Q8_0 99.44 -> 99.33 %) and a KL mean under
// 1e-4 (the bundled Q4_1's bf16 GEMM: 1.9e-4), and a Q8_0 / Q6_K prompt runs 1.2-1.3x faster; one
// term everywhere took the mixes whose layers are 4- and 5-bit (Q4_0, Q4_K, Q5_0, Q5_K) under 99 %
// (Q3_K_M 98.49 %, Q4_K_M 98.88 %, Gemma 3 98.94 %).
template <class D>
constexpr int kTerms = D::kFmt == tm_vnni::kQ8 || D::kFmt == tm_vnni::kQ6K ? 1 : 2;

#if TM_AMX_COMPILES

// Quad j's values (v[i]: columns 4 i .. 4 i + 3, lane 4 c + e) as bf16 into B's rows 2 j, 2 j + 1: dword
// 2 c' + h of lo8 / hi8 is column c' (of 0-7 / 8-15), inputs 4 j + 2 h, + 1.
TA_TARGET TA_INLINE void store_rows(const __m512 (&v)[4], uint16_t* b, int j) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i lo8 = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);
  const __m512i hi8 = (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]);
  _mm512_storeu_si512(b + (2 * j) * 32, _mm512_permutex2var_epi32(lo8, even, hi8));
  _mm512_storeu_si512(b + (2 * j + 1) * 32, _mm512_permutex2var_epi32(lo8, odd, hi8));
}

// A group's codes minus the offset as bf16 in B's layout: row i holds inputs 2 i, 2 i + 1 of the 16
// columns (dword c = column c). Quad j (inputs 4 j .. 4 j + 3; byte 4 c + e) gives rows 2 j, 2 j + 1.
// `sub` (kFolds, kFoldsScale formats): each half's 16 column scales, multiplied in; `b_lo` (kPlanes
// 2): what bf16 left of each product, as a second B.
template <class D>
TA_TARGET TA_INLINE void decode_group_b(const uint8_t* p, uint16_t* b, const __m512* sub = nullptr, uint16_t* b_lo = nullptr) {
  __m512i q[8];
  tm_vnni::pair<D, 0>(p, q[0], q[4]);
  tm_vnni::pair<D, 1>(p, q[1], q[5]);
  tm_vnni::pair<D, 2>(p, q[2], q[6]);
  tm_vnni::pair<D, 3>(p, q[3], q[7]);
  const __m512i off = _mm512_set1_epi32(D::kOffset);
  const __m512i lane_col = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    __m512 v[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // columns 4 i .. 4 i + 3, lane 4 c + e
      const __m128i bytes = i == 0 ? _mm512_extracti32x4_epi32(q[j], 0) : i == 1 ? _mm512_extracti32x4_epi32(q[j], 1)
                            : i == 2 ? _mm512_extracti32x4_epi32(q[j], 2) : _mm512_extracti32x4_epi32(q[j], 3);
      v[i] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), off));
      if (sub != nullptr)  // times column 4 i + c's scale of half j / 4
        v[i] = _mm512_mul_ps(v[i], _mm512_permutexvar_ps(_mm512_add_epi32(lane_col, _mm512_set1_epi32(4 * i)), sub[j / 4]));
    }
    store_rows(v, b, j);
    if (b_lo != nullptr) {  // what bf16 left of each value: a second plane
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v[i]));
        v[i] = _mm512_sub_ps(v[i], _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
      }
      store_rows(v, b_lo, j);
    }
  }
}

// Groups g0..g1 of one column block: B tiles (1 kB a group and plane) and scales and mins per run of units
// ([runs, 16] fp32 each; mins only for formats with them): per unit, for kFolds formats the
// super-block's d (its sub-block scales in B), for kFoldsScale formats one run of ones (all of the
// scale in B). g0 is a whole number of super-blocks for the super-block formats.
template <class D>
TA_TARGET void decode_block(const Weights& w, int64_t nb, int64_t g0, int64_t g1, uint16_t* b, float* sc, float* mn) {
  const bool has_min = D::has_min(w);
  if constexpr (kFoldsScale<D>) _mm512_storeu_ps(sc, _mm512_set1_ps(1.0f));
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* codes = w.codes + (nb * w.G + g) * D::kBits * 64;
    uint16_t* bg = b + (g - g0) * 512 * kPlanes<D>;
    if constexpr (kFoldsScale<D>) {
      __m512 s[D::kSubs];
      D::scales(w, nb, g, s);
      const __m512 sub[2] = {s[0], s[D::kSubs - 1]};  // each half's column scales
      decode_group_b<D>(codes, bg, sub, bg + 512);
      continue;
    }
    if constexpr (kFolds<D>) {
      const int64_t j = g % tm_vnni::kSuper;
      const __m512 sub[2] = {tm_vnni::load_i8x16(D::sub(w, nb, g, 2 * j)), tm_vnni::load_i8x16(D::sub(w, nb, g, 2 * j + 1))};
      decode_group_b<D>(codes, bg, sub);
      if (j == 0) _mm512_storeu_ps(sc + ((g - g0) / tm_vnni::kSuper) * kCols, tm_vnni::load_half16(w.scales + D::at(w, nb, g)));
      continue;
    }
    decode_group_b<D>(codes, bg);
    __m512 s[D::kSubs], m[D::kSubs];
    D::scales(w, nb, g, s);
    if (has_min) D::mins(w, nb, g, m);
    for (int h = 0; h < D::kSubs; ++h) {
      _mm512_storeu_ps(sc + ((g - g0) * D::kSubs + h) * kCols, s[h]);
      if (has_min) _mm512_storeu_ps(mn + ((g - g0) * D::kSubs + h) * kCols, m[h]);
    }
  }
}

#endif  // TM_AMX_COMPILES

}  // namespace tm_amx
