#pragma once
// Quantized linear layers on AMX-INT8 tiles for steps of a few dozen rows (a 16-stream decode step's
// linears and lm_head, an expert's rows op by op), y[M, N] = x[M, K] @ W^T, over the column-blocked
// weights of the super-block formats whose sub-block scales are integers (Q3_K, Q4_K, Q5_K, Q6_K,
// IQ4_XS).
//
// Why: from ~12 rows the VNNI kernel (quant_vnni.h) is bound by its vpdpbusd (16 a group, row and
// block for two int8 terms: the 16-stream MoE step's Q6_K lm_head took 4.3-6 ms for its 41 MB), and
// the AMX-BF16 tiles (quant_amx.h) only pay from ~48 rows: below, decoding each weight into bf16
// costs more than the products it saves. AMX-INT8 multiplies 16 x 64 int8 by 64 x 16 in one
// instruction, and the blocked layout's quads (4 inputs x 16 columns) are already its B layout.
// What it needs is integers that sum over a whole super-block:
//   - each weight as (code - offset) x its integer sub-block scale: at most 14 bits, so B is two int8
//     planes, hi = v >> 7 and lo = v & 127 (v = 128 hi + lo), decoded once per call in int16 lanes;
//   - each activation as two int8 terms on one scale per 256 inputs (d1 = amax / 127, the residual
//     on steps of d2 = d1 / 256: ~15 bits of the 256 inputs' amax, where the VNNI kernel's are of
//     its group of 32's), so that the 4 x 64 inputs
//     of a super-block accumulate in int32 tiles: 4 products (two terms x two planes) per 64 inputs,
//     one store and scaling per 256 (by the super-block's d) instead of per 32 or 16.
// The mins (Q4_K, Q5_K) are added per group of 32 from the rounded activations' sums, as the VNNI
// kernel does, so that the rounding errors cancel. Results are within the two-term rounding bound of
// the float64 product with the per-256 amax (tests/model/test_quant_amx8.py); they are not the VNNI
// kernel's bits.
// Tiles: 0-3 the sums (term 1 x hi, term 1 x lo, term 2 x hi, term 2 x lo), 4-5 A (the two terms of
// 16 rows x 64 inputs), 6-7 B (the planes).

#include <immintrin.h>

#include "quant_amx8_acts.h"
#include "quant_amx_acts.h"
#include "quant_blocks.h"

#include <algorithm>
#include <cstdint>

namespace tm_amx8 {

using tm_vnni::kCols;
using tm_vnni::kGroup;
using tm_vnni::kSuper;
using tm_vnni::Weights;

constexpr int64_t kRows = kTileRows;  // rows of an A tile

// From how many rows a step of a folding format runs here (below the AMX-BF16 tiles' kAmxMinRows):
// Q6_K's 49,152 x 1,024 lm_head at 8 / 12 / 16 / 32 rows took 2.26 / 2.37 / 2.52 / 4.88 ms against the
// VNNI kernel's 2.40 / 3.80 / 4.92 / 9.89, Q4_K 1,024 x 1,024 at 8 / 12 rows 0.105 / 0.059 against
// 0.086 / 0.078 (docs/benchmarks.md, "AMX-INT8 tiles for steps of 12-47 rows").
constexpr int64_t kAmx8MinRows = 12;

// Formats whose (code - offset) x sub-block scale is an integer that two int8 planes hold.
constexpr bool folds(int fmt) {
  return fmt == tm_vnni::kQ3K || fmt == tm_vnni::kQ4K || fmt == tm_vnni::kQ5K || fmt == tm_vnni::kQ6K ||
         fmt == tm_vnni::kIQ4XS;
}

inline bool ready() {
#if TM_AMX_COMPILES
  static const bool yes = [] {
    __builtin_cpu_init();
    return tm_amx::amx_ready() && __builtin_cpu_supports("amx-int8");
  }();
  return yes;
#else
  return false;
#endif
}

#if TM_AMX_COMPILES

// A sub-block's 16 integer scales as int16 lanes for a quad's bytes widened by unpacklo (even) and
// unpackhi (odd): lane i of 128-bit lane L is column 4 L + i / 4 (+ 2 for unpackhi).
template <class D>
T8_TARGET TA_INLINE void sub_lanes(const uint8_t* p, __m512i& even, __m512i& odd) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i s16 = _mm512_castsi256_si512(D::kKind == tm_vnni::Sub::kInt8 ? _mm256_cvtepi8_epi16(bytes)
                                                                             : _mm256_cvtepu8_epi16(bytes));
  alignas(64) static constexpr uint16_t kEven[32] = {0, 0, 0, 0, 1, 1, 1, 1, 4, 4, 4, 4, 5, 5, 5, 5,
                                                     8, 8, 8, 8, 9, 9, 9, 9, 12, 12, 12, 12, 13, 13, 13, 13};
  const __m512i col = _mm512_load_si512(kEven);
  even = _mm512_permutexvar_epi16(col, s16);
  odd = _mm512_permutexvar_epi16(_mm512_add_epi16(col, _mm512_set1_epi16(2)), s16);
}

// Quad `code` (unsigned codes) times its columns' scales, minus offset x scale, into the planes.
T8_TARGET TA_INLINE void to_planes(__m512i code, const __m512i (&s)[2], const __m512i (&off)[2], int8_t* hi, int8_t* lo) {
  const __m512i z = _mm512_setzero_si512();
  const __m512i a = _mm512_sub_epi16(_mm512_mullo_epi16(_mm512_unpacklo_epi8(code, z), s[0]), off[0]);
  const __m512i b = _mm512_sub_epi16(_mm512_mullo_epi16(_mm512_unpackhi_epi8(code, z), s[1]), off[1]);
  const __m512i m7 = _mm512_set1_epi16(127);
  _mm512_store_si512(lo, _mm512_packs_epi16(_mm512_and_si512(a, m7), _mm512_and_si512(b, m7)));
  _mm512_store_si512(hi, _mm512_packs_epi16(_mm512_srai_epi16(a, 7), _mm512_srai_epi16(b, 7)));
}

// Super-block s of column block nb as B: [4 steps of 64 inputs][plane hi, lo][16 quads][64 bytes].
template <class D>
T8_TARGET void decode_super(const Weights& w, int64_t nb, int64_t s, int8_t* B) {
  for (int j = 0; j < kSuper; ++j) {
    const int64_t g = s * kSuper + j;
    const uint8_t* p = w.codes + (nb * w.G + g) * D::kBits * 64;
    tm_vnni::fetch_far<D>(w, p, nb, g);
    __m512i sc[2][2], off[2][2];  // [half][even, odd]
    for (int h = 0; h < D::kSubs; ++h) {
      sub_lanes<D>(D::sub(w, nb, g, D::kSubs * j + h), sc[h][0], sc[h][1]);
      for (int e = 0; e < 2; ++e) off[h][e] = _mm512_mullo_epi16(sc[h][e], _mm512_set1_epi16(D::kOffset));
    }
    if constexpr (D::kSubs == 1) {
      sc[1][0] = sc[0][0], sc[1][1] = sc[0][1], off[1][0] = off[0][0], off[1][1] = off[0][1];
    }
    int8_t* b = B + (j / 2) * 2048 + (j % 2) * 512;
    __m512i lo, hi;
#define T8_QUADS(J)                                                          \
  tm_vnni::pair<D, J>(p, lo, hi);                                            \
  to_planes(lo, sc[0], off[0], b + (J) * 64, b + 1024 + (J) * 64);           \
  to_planes(hi, sc[1], off[1], b + ((J) + 4) * 64, b + 1024 + ((J) + 4) * 64);
    T8_QUADS(0) T8_QUADS(1) T8_QUADS(2) T8_QUADS(3)
#undef T8_QUADS
  }
}

// Column blocks nb0..nb1 of weight w (its columns from y + col0) for all rows.
template <class D>
T8_TARGET void blocks_of(const Weights& w, const Acts8& a, int64_t nb0, int64_t nb1, float* y, int64_t N) {
  const int64_t K = a.K, S = K / kSuperInputs, G = K / kGroup, Mp = a.Mp;
  alignas(64) int8_t B[4 * 2048];
  alignas(64) int32_t C[4][kRows][kCols];
  alignas(64) float acc[tm_amx::kAmxMinRows + kRows][kCols];
  const bool has_min = D::has_min(w);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    for (int64_t m = 0; m < Mp; ++m) _mm512_store_ps(acc[m], _mm512_setzero_ps());
    for (int64_t s = 0; s < S; ++s) {
      decode_super<D>(w, nb, s, B);
      const __m512 d = tm_vnni::load_half16(w.scales + D::at(w, nb, s * kSuper));
      for (int64_t m0 = 0; m0 < Mp; m0 += kRows) {
        const int8_t* q1 = a.q + m0 * K + s * kSuperInputs;
        const int8_t* q2 = q1 + Mp * K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int k = 0; k < 4; ++k) {
          _tile_loadd(4, q1 + 64 * k, K);
          _tile_loadd(5, q2 + 64 * k, K);
          _tile_loadd(6, B + 2048 * k, 64);
          _tile_loadd(7, B + 2048 * k + 1024, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbssd(1, 4, 7);
          _tile_dpbssd(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
        }
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        _tile_stored(2, C[2], 64);
        _tile_stored(3, C[3], 64);
        const int64_t rows = std::min<int64_t>(kRows, a.M - m0);
        for (int64_t r = 0; r < rows; ++r) {
          // term 1: 128 hi + lo, exact in int32 (< 2^27); x 256 over term 2's in fp32
          const __m512i t1 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(C[0][r]), 7), _mm512_load_si512(C[1][r]));
          const __m512i t2 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(C[2][r]), 7), _mm512_load_si512(C[3][r]));
          const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t1), _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(t2));
          const __m512 dr = _mm512_mul_ps(d, _mm512_set1_ps(a.d2[(m0 + r) * S + s]));
          _mm512_store_ps(acc[m0 + r], _mm512_fmadd_ps(v, dr, _mm512_load_ps(acc[m0 + r])));
        }
      }
      if (has_min) {
        for (int j = 0; j < kSuper; ++j) {
          __m512 mn[D::kSubs];
          D::mins(w, nb, s * kSuper + j, mn);
          for (int64_t m = 0; m < a.M; ++m)
            _mm512_store_ps(acc[m], _mm512_fmadd_ps(mn[0], _mm512_set1_ps(a.gsum[m * G + s * kSuper + j]), _mm512_load_ps(acc[m])));
        }
      }
    }
    for (int64_t m = 0; m < a.M; ++m) _mm512_storeu_ps(y + m * N + nb * kCols, _mm512_load_ps(acc[m]));
  }
}

// Column blocks nb0..nb1 of a folding format's weight (columns from y) for all of a's rows, on this
// thread's tiles: the fused decode step's kit (decode_kits.h) and `multiply` below.
T8_TARGET inline void blocks(const Weights& w, const Acts8& a, int64_t nb0, int64_t nb1, float* y, int64_t N) {
  _tile_loadconfig(&tm_amx::full_tiles());  // every tile 16 rows x 64 bytes
  tm_vnni::with_decoder(w.fmt, [&]<class D>() {
    if constexpr (folds(D::kFmt)) blocks_of<D>(w, a, nb0, nb1, y, N);
  });
  _tile_release();
}

#endif  // TM_AMX_COMPILES

}  // namespace tm_amx8
