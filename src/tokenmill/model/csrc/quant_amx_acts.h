#pragma once
// Activations as the AMX-BF16 tiles take them (quant_amx.h): each row as two bf16 terms, hi = bf16(x)
// and lo = bf16(x - hi) (~16 bits), in AMX's A layout (bf16 [Mp, K], rows padded with zeros to whole
// tiles of 16), and the rows' fp32 sums per 16 and per 32 inputs (the formats' min terms).
//
// Why a file of its own: the op-by-op linear (quant_amx.h `multiply`) and the fused decode step's kit
// (decode_kits.h, which rounds a step's rows once for every linear that reads them) fill the same
// layout, and the VNNI activations (quant_acts.h) carry it beside their int8 terms.

#include <immintrin.h>

#include "amx_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tm_amx {

constexpr int64_t kTileRows = 16;

// From how many rows two-term steps run on the tiles where the CPU has them: measured against the
// VNNI kernel on SmolLM2's and the MoE's shapes, 2 threads (docs/benchmarks.md, "AMX-BF16 tiles"):
// about even from 16 to 48 rows, 1.1-1.45x at 64, 1.5-2x at 512.
constexpr int64_t kAmxMinRows = 48;

// Rows of x in AMX's A layout: bf16 [Mp, K] twice (hi, lo), and the sums of x per 16 and per 32
// inputs (the min terms), Mp = M rounded up to whole tiles, the padding rows zero. lo and the sums
// are null where no tile reads them (SplitNeeds).
struct SplitActs {
  uint16_t* hi = nullptr;  // null: not split (the tiles do not run)
  uint16_t* lo = nullptr;
  float* sum16 = nullptr;  // [Mp, K / 16]
  float* sum32 = nullptr;  // [Mp, K / 32]
  int64_t Mp = 0, K = 0;
};

// What of the split a step's tiles read (quant_amx_calls.h `needs_of`): hi always, lo where a tile
// multiplies two terms, the sums where a format has a min. Why: a step whose formats take hi alone
// and have no min (Q8_0, Q6_K) spent ~5 % of a 512-token prompt making lo and the sums (their
// horizontal adds), which nothing read.
struct SplitNeeds {
  bool lo = true, sums = true;
};

// M rounded up to whole tiles of rows.
inline int64_t padded_rows(int64_t M) { return (M + kTileRows - 1) / kTileRows * kTileRows; }

// Floats of scratch that M rows of K inputs take split (make_split's layout; K a multiple of 32).
inline int64_t split_floats(int64_t M, int64_t K, SplitNeeds needs = {}) {
  // hi and lo: a bf16 a value each, half a float
  return padded_rows(M) * (K / 2 + (needs.lo ? K / 2 : 0) + (needs.sums ? K / 16 + K / 32 : 0));
}

// The split of M rows of K inputs laid out in `base` (split_floats(M, K, needs) floats, 64-byte aligned).
inline SplitActs make_split(float* base, int64_t M, int64_t K, SplitNeeds needs = {}) {
  const int64_t Mp = padded_rows(M);
  uint16_t* hi = reinterpret_cast<uint16_t*>(base);
  uint16_t* lo = needs.lo ? hi + Mp * K : nullptr;
  float* sums = needs.sums ? base + Mp * K / 2 + (needs.lo ? Mp * K / 2 : 0) : nullptr;
  return SplitActs{hi, lo, sums, sums != nullptr ? sums + Mp * (K / 16) : nullptr, Mp, K};
}

#if TM_AMX_COMPILES
// Rows m0..m1 of x [M, K] into a (rows from M on: zeros), the parts Lo and Sums too.
template <bool Lo, bool Sums>
TA_TARGET inline void split_parts(const float* x, int64_t m0, int64_t m1, int64_t M, const SplitActs& a) {
  const int64_t K = a.K;
  for (int64_t m = m0; m < m1; ++m) {
    uint16_t* h = a.hi + m * K;
    uint16_t* l = Lo ? a.lo + m * K : nullptr;
    float* s16 = Sums ? a.sum16 + m * (K / 16) : nullptr;
    float* s32 = Sums ? a.sum32 + m * (K / 32) : nullptr;
    if (m >= M) {
      std::memset(h, 0, K * 2);
      if constexpr (Lo) std::memset(l, 0, K * 2);
      if constexpr (Sums) {
        std::fill(s16, s16 + K / 16, 0.f);
        std::fill(s32, s32 + K / 32, 0.f);
      }
      continue;
    }
    const float* xr = x + m * K;
    for (int64_t k = 0; k < K; k += 32) {
      const __m512 a0 = _mm512_loadu_ps(xr + k), a1 = _mm512_loadu_ps(xr + k + 16);
      const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(a1, a0);
      _mm512_storeu_si512(h + k, hi);
      if constexpr (Lo) {
        // hi's values back in fp32 (bf16 is fp32's upper half), the residual exact in fp32
        const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
        const __m512 h1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16));
        _mm512_storeu_si512(l + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(a1, h1), _mm512_sub_ps(a0, h0)));
      }
      if constexpr (Sums) {
        const float s0 = _mm512_reduce_add_ps(a0), s1 = _mm512_reduce_add_ps(a1);
        s16[k / 16] = s0;
        s16[k / 16 + 1] = s1;
        s32[k / 32] = s0 + s1;
      }
    }
  }
}

// Rows m0..m1 of x [M, K] into a: the parts it has (make_split's needs).
TA_TARGET inline void split_into(const float* x, int64_t m0, int64_t m1, int64_t M, const SplitActs& a) {
  const bool lo = a.lo != nullptr, sums = a.sum16 != nullptr;
  if (lo && sums) split_parts<true, true>(x, m0, m1, M, a);
  else if (lo) split_parts<true, false>(x, m0, m1, M, a);
  else if (sums) split_parts<false, true>(x, m0, m1, M, a);
  else split_parts<false, false>(x, m0, m1, M, a);
}
#else
inline void split_into(const float*, int64_t, int64_t, int64_t, const SplitActs&) {}
#endif

}  // namespace tm_amx
