#pragma once
// Activations as the AMX-INT8 tiles take them (quant_amx8.h): each row as two int8 terms on one scale
// per 256 inputs (d1 = amax / 127, the residual on steps of d2 = d1 / 256), in AMX's A layout (int8
// [2][Mp][K], rows padded with zeros to whole tiles of 16), d2 per row and super-block, and the
// rounded values' sums per group of 32 (the min terms).
//
// Why a file of its own: the op-by-op linear (quant_amx8.h `multiply`) and the fused decode step's
// kit (decode_kits.h, which rounds a step's rows once for every linear that reads them) fill the same
// layout, and the VNNI activations (quant_acts.h) carry it beside their int8 terms, as they carry
// the AMX-BF16 split (quant_amx_acts.h).

#include <immintrin.h>

#include "amx_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#define T8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,amx-tile,amx-int8")))
#define T8_ROUND_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

namespace tm_amx8 {

constexpr int64_t kSuperInputs = 256;
constexpr int64_t kGroupInputs = 32;
constexpr int64_t kTileRows = 16;

// q == nullptr: not rounded for the tiles (the step does not run them).
struct Acts8 {
  int8_t* q = nullptr;
  float* d2 = nullptr;
  float* gsum = nullptr;
  int64_t M = 0, Mp = 0, K = 0;
};

inline int64_t padded_rows(int64_t M) { return (M + kTileRows - 1) / kTileRows * kTileRows; }

// Floats of scratch that M rows of K inputs take (make_acts8's layout).
inline int64_t acts8_floats(int64_t M, int64_t K) {
  const int64_t Mp = padded_rows(M);
  return (2 * Mp * K + 3) / 4 + Mp * (K / kSuperInputs + K / kGroupInputs);
}

// The Acts8 of M rows of K inputs (a multiple of 256) laid out in `base` (acts8_floats(M, K) floats,
// 64-byte aligned for the tile loads' rows).
inline Acts8 make_acts8(float* base, int64_t M, int64_t K) {
  const int64_t Mp = padded_rows(M);
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* d2 = base + (2 * Mp * K + 3) / 4;
  return Acts8{q, d2, d2 + Mp * (K / kSuperInputs), M, Mp, K};
}

// Rows m0..m1 of x [M, K] into a (rows from M on: zeros).
T8_ROUND_TARGET inline void quantize_rows(const float* x, int64_t m0, int64_t m1, const Acts8& a) {
  const int64_t K = a.K, S = K / kSuperInputs, G = K / kGroupInputs;
  for (int64_t m = m0; m < m1; ++m) {
    int8_t* q1 = a.q + m * K;
    int8_t* q2 = q1 + a.Mp * K;
    float* gs = a.gsum + m * G;
    if (m >= a.M) {
      std::memset(q1, 0, K);
      std::memset(q2, 0, K);
      std::fill(a.d2 + m * S, a.d2 + (m + 1) * S, 0.f);
      std::fill(gs, gs + G, 0.f);
      continue;
    }
    for (int64_t s = 0; s < S; ++s) {
      const float* xp = x + m * K + s * kSuperInputs;
      __m512 amax = _mm512_setzero_ps();
      for (int i = 0; i < kSuperInputs; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xp + i)));
      const float d1 = _mm512_reduce_max_ps(amax) / 127.f, d2 = d1 / 256.f;
      const __m512 vd1 = _mm512_set1_ps(d1), i1 = _mm512_set1_ps(d1 > 0 ? 1.f / d1 : 0.f),
                   i2 = _mm512_set1_ps(d2 > 0 ? 1.f / d2 : 0.f);
      for (int i = 0; i < kSuperInputs; i += kGroupInputs) {
        __m512i sum = _mm512_setzero_si512();
        for (int h = 0; h < kGroupInputs; h += 16) {
          const __m512 v = _mm512_loadu_ps(xp + i + h);
          const __m512 t1 = _mm512_roundscale_ps(_mm512_mul_ps(v, i1), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          const __m512 r = _mm512_fnmadd_ps(t1, vd1, v);
          const __m512i k1 = _mm512_cvtps_epi32(t1), k2 = _mm512_cvtps_epi32(_mm512_mul_ps(r, i2));
          const int64_t at = s * kSuperInputs + i + h;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + at), _mm512_cvtsepi32_epi8(k1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + at), _mm512_cvtsepi32_epi8(k2));
          // the sum of what the terms hold (k2 saturated as stored): 256 k1 + k2 in units of d2
          const __m512i k2s = _mm512_max_epi32(_mm512_min_epi32(k2, _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
          sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_slli_epi32(k1, 8), k2s));
        }
        gs[s * (kSuperInputs / kGroupInputs) + i / kGroupInputs] = static_cast<float>(_mm512_reduce_add_epi32(sum)) * d2;
      }
      a.d2[m * S + s] = d2;
    }
  }
}

}  // namespace tm_amx8
