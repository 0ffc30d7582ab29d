#pragma once
// Quantized linear layers on AVX512-VNNI over a column-blocked weight layout, y[M, N] = x[M, K] @ W^T.
//
// Why a second layout: with weights in row order (quant_linear.cpp), each int32 lane of a dot
// product belongs to one output column's partial sum over K, so every group of 32 needs its scale
// broadcast into a lane pattern and the lanes reduced at the end: ~15 instructions per 64 weights,
// which made batch-1 decode compute-bound. Here a zmm holds 4 consecutive k of 16 output columns
// (model/quant.py `to_blocked`), so one vpdpbusd adds x[k..k+3] (broadcast) times 16 columns' codes
// into 16 column accumulators: a group of 32 is 8 vpdpbusd per row, its scales one fp16 load for 16
// columns, and there is no horizontal reduction at all (the 16 results are 16 adjacent outputs).
//
// Blocked layout, per block of 16 output columns (nb) and group of 32 inputs (g):
//   int4: codes uint8 [N/16, G, 4, 64]: zmm t holds quad t in its low nibbles and quad t + 4 in its
//         high nibbles; quad j, byte c * 4 + e = code of column 16 nb + c at k = 32 g + 4 j + e.
//   int8: codes uint8 [N/16, G, 8, 64]: zmm j = quad j, same byte order, each code stored + 128.
//   scales, mins: fp16 [N/16, G, 16].
//
// Activations are rounded to int8 per group of 32 (scale amax / 127, nearest even), as llama.cpp's
// Q8 activations, and with `terms` = 2 the rounding residual is rounded to int8 again (its own scale,
// ~1/254 of the first): x ~ d1 q1 + d2 q2, about 15 bits per activation for 8 more vpdpbusd per group
// and row. One term measured KL(exact || fast) 0.0028 nats and top-1 agreement 97% on held-out text,
// two terms are within rounding of fp32 activations (docs/benchmarks.md). The min term uses the rounded
// activations' sums so that rounding errors cancel.
// vpdpbusd multiplies unsigned by signed bytes: the codes are the unsigned side (int8 codes stored
// + 128, so the dot product gains 128 * sum(x) per group, which the int32 sums start from:
// no extra bytes per weight).
//
// Where the time goes (Zen 4, 2 threads): from 2 rows on, the vpdpbusd. A zmm vpdpbusd and an fp32
// multiply or FMA share the same two pipes (one zmm op a cycle between them), while integer adds,
// logic and conversions go elsewhere. Per row, group and block the two terms are 16 vpdpbusd, and
// the scaling is 3 more (d1 D1, + d2 D2, * scale) plus 1 for the min: ~1.25 cycles per vpdpbusd at
// best, and a tile of 8 rows runs at ~1.3. So a tile keeps each (row, term) int32 sum in a register
// for the whole group, scales once per group, and shares each block's unpacked codes across up to 8
// rows. Tiles of 2 or 4 blocks (each activation broadcast feeding several vpdpbusd) were no faster
// with the weights in cache and up to 1.5x slower streaming them from memory, as every step does
// (SmolLM2-135M: 96 MB of weights, 32 MB of L3): one block at a time reads the codes front to back.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

namespace tm_vnni {
namespace {

#define TV_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define TV_INLINE inline __attribute__((always_inline))

constexpr int64_t kGroup = 32;
constexpr int64_t kCols = 16;

// Quantized activations, group-major so that a tile's rows of one group sit at constant offsets
// from one pointer (a row-major layout needed a pointer per row and term: spilled registers).
struct Acts {
  int8_t* xq;        // [G, M, terms, 32] rounded activations (term 2: the residual of term 1)
  float* dx;         // [G, M, terms] scale per group and term
  float* qsum;       // [G, M] sum over terms of dx * sum of the group's rounded values (min term)
  int32_t* nsum128;  // [G, M, terms] -128 * sum of the group's rounded values (int8 weights' offset)
  int64_t M;
};

struct Weights {
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* mins;   // or nullptr
  int64_t G;
  int bits;
};

// One group (32 values in lo, hi) rounded to `terms` int8 terms: the reference for quantize4.
TV_TARGET TV_INLINE void quantize1(__m512 lo, __m512 hi, int terms, int8_t* xq, float* dx, float* qsum,
                                   int32_t* nsum128) {
  float total_sum = 0.f;
  for (int t = 0; t < terms; ++t) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    const float scale = amax / 127.f;
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    dx[t] = scale;
    total_sum = std::fma(scale, static_cast<float>(total), total_sum);
    nsum128[t] = -128 * total;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + t * kGroup), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + t * kGroup + 16), _mm512_cvtsepi32_epi8(qhi));
    // what this term left out, for the next one
    const __m512 s = _mm512_set1_ps(scale);
    lo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo), s, lo);
    hi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi), s, hi);
  }
  *qsum = total_sum;
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
TV_TARGET TV_INLINE void quantize4(const float* src, int8_t* xq, float* dx, float* qsum, int32_t* nsum128,
                                   int64_t stride) {
  __m512 lo[4], hi[4];
  for (int i = 0; i < 4; ++i) {
    lo[i] = _mm512_loadu_ps(src + i * kGroup);
    hi[i] = _mm512_loadu_ps(src + i * kGroup + 16);
  }
  __m512 total_sum = _mm512_setzero_ps();
  alignas(64) float scales[Terms][16];
  alignas(64) int32_t totals[Terms][16];
  for (int t = 0; t < Terms; ++t) {
    __m512 m[4];
    for (int i = 0; i < 4; ++i) m[i] = _mm512_max_ps(_mm512_abs_ps(lo[i]), _mm512_abs_ps(hi[i]));
    const __m512 amax = max4(m);
    const __mmask16 nonzero = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 inv = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(127.f), amax);
    const __m512 scale = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
    __m512i qlo[4], qhi[4], s[4];
    __m512 inv_i[4] = {chunk<0>(inv), chunk<1>(inv), chunk<2>(inv), chunk<3>(inv)};
    __m512 sc_i[4] = {chunk<0>(scale), chunk<1>(scale), chunk<2>(scale), chunk<3>(scale)};
    for (int i = 0; i < 4; ++i) {
      qlo[i] = _mm512_cvtps_epi32(_mm512_mul_ps(lo[i], inv_i[i]));
      qhi[i] = _mm512_cvtps_epi32(_mm512_mul_ps(hi[i], inv_i[i]));
      s[i] = _mm512_add_epi32(qlo[i], qhi[i]);
      int8_t* dst = xq + (i * stride * Terms + t) * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo[i]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi[i]));
      lo[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo[i]), sc_i[i], lo[i]);
      hi[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi[i]), sc_i[i], hi[i]);
    }
    const __m512i total = sum4(s);
    total_sum = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(total), total_sum);
    _mm512_store_ps(scales[t], scale);
    _mm512_store_si512(totals[t], total);
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, total_sum);
  for (int i = 0; i < 4; ++i) {
    for (int t = 0; t < Terms; ++t) {
      dx[i * stride * Terms + t] = scales[t][4 * i];
      nsum128[i * stride * Terms + t] = -128 * totals[t][4 * i];
    }
    qsum[i * stride] = sums[4 * i];
  }
}

// Rows m0..m1 of x [M, K] into the group-major layout of Acts.
template <int Terms>
TV_TARGET void quantize_rows(const float* x, int64_t K, int64_t m0, int64_t m1, const Acts& a) {
  const int64_t G = K / kGroup, M = a.M;
  int8_t* xq = a.xq;
  float *dx = a.dx, *qsum = a.qsum;
  int32_t* nsum128 = a.nsum128;
  for (int64_t m = m0; m < m1; ++m) {
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {
      const int64_t at = g * M + m;  // record of (g, m); the next group's is M records on
      quantize4<Terms>(x + m * K + g * kGroup, xq + at * Terms * kGroup, dx + at * Terms, qsum + at,
                       nsum128 + at * Terms, M);
    }
    for (; g < G; ++g) {
      const int64_t at = g * M + m;
      __m512 lo = _mm512_loadu_ps(x + m * K + g * kGroup), hi = _mm512_loadu_ps(x + m * K + g * kGroup + 16);
      quantize1(lo, hi, Terms, xq + at * Terms * kGroup, dx + at * Terms, qsum + at, nsum128 + at * Terms);
    }
  }
}

TV_TARGET TV_INLINE __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The 8 quads (16 columns x 4 inputs of unsigned codes each) of one block of 16 columns and 32 inputs.
TV_TARGET TV_INLINE void unpack_block(const Weights& w, int64_t blk, int bits, __m512i (&q)[8]) {
  if (bits == 4) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const uint8_t* p = w.codes + blk * 256;
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(p + t * 64);
      q[t] = _mm512_and_si512(v, nibble);
      q[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
  } else {
    for (int j = 0; j < 8; ++j) q[j] = _mm512_loadu_si512(w.codes + blk * 512 + j * 64);
  }
}

// R rows (m0..) x the 16 columns of block nb. Per group, each (row, term) sums its 8 vpdpbusd in an
// int32 register, scaled into the row's fp32 result once: 3 R + 3 zmm registers (R <= 8 of 32).
template <int R, int Bits, int Terms>
TV_TARGET void tile(const Weights& w, const Acts& a, int64_t N, int64_t m0, int64_t nb, float* y) {
  constexpr int64_t kBytes = Bits == 4 ? 256 : 512;  // codes of one block and group
  const int64_t G = w.G, M = a.M;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* codes = w.codes + nb * G * kBytes;
  const uint16_t* scales = w.scales + nb * G * kCols;
  const uint16_t* mins = w.mins != nullptr ? w.mins + nb * G * kCols : nullptr;
  const int8_t* xq = a.xq + m0 * Terms * kGroup;
  const float* dx = a.dx + m0 * Terms;
  const float* qsum = a.qsum + m0;
  const int32_t* nsum128 = a.nsum128 + m0 * Terms;
  for (int64_t g = 0; g < G; ++g) {
    // 2 kB ahead: with the weights streamed from memory, as in a real step, int4 layers ran ~15%
    // faster at 1-2 rows. The int8 lm_head at 1-2 rows is bound by bandwidth alone and ran ~10%
    // slower with it (from 3 rows, where compute has to overlap the reads, 1.5x faster at 8).
    constexpr int kPrefetchLines = Bits == 4 || R > 2 ? kBytes / 64 : 0;
#pragma GCC unroll 8
    for (int l = 0; l < kPrefetchLines; ++l) _mm_prefetch(reinterpret_cast<const char*>(codes + 2048 + l * 64), _MM_HINT_T0);
    // With few rows the sums are chains of dependent vpdpbusd (8 a group and term): a second set of
    // sums (the high nibbles, or odd quads) halves the chains; with more rows the rows give the
    // independence, and the registers are needed for them.
    constexpr bool kTwoChains = R <= 2;
    __m512i dot[R][Terms], dot2[R][Terms];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int t = 0; t < Terms; ++t) {
        // int8 codes are stored + 128: the sum starts from -128 * sum(x), no subtraction later
        if constexpr (Bits == 8) dot[r][t] = _mm512_set1_epi32(nsum128[r * Terms + t]);
        else dot[r][t] = _mm512_setzero_si512();
        dot2[r][t] = _mm512_setzero_si512();
      }
    if constexpr (Bits == 4) {
      const __m512i nibble = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(codes + j * 64);
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
          for (int t = 0; t < Terms; ++t) {
            const int8_t* xp = xq + (r * Terms + t) * kGroup + 4 * j;
            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo, bcast4(xp));
            if constexpr (kTwoChains) dot2[r][t] = _mm512_dpbusd_epi32(dot2[r][t], hi, bcast4(xp + 16));
            else dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi, bcast4(xp + 16));
          }
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i q = _mm512_loadu_si512(codes + j * 64);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
          for (int t = 0; t < Terms; ++t)
            if (kTwoChains && j % 2 == 1) dot2[r][t] = _mm512_dpbusd_epi32(dot2[r][t], q, bcast4(xq + (r * Terms + t) * kGroup + 4 * j));
            else dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], q, bcast4(xq + (r * Terms + t) * kGroup + 4 * j));
      }
    }
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if constexpr (kTwoChains)
        for (int t = 0; t < Terms; ++t) dot[r][t] = _mm512_add_epi32(dot[r][t], dot2[r][t]);
      // (d1 D1 + d2 D2) * scale: 3 multiplies a row, against 4 for D1 * (scale d1) + D2 * (scale d2)
      __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][0]), _mm512_set1_ps(dx[r * Terms]));
      if constexpr (Terms == 2) s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), _mm512_set1_ps(dx[r * Terms + 1]), s);
      acc[r] = _mm512_fmadd_ps(s, sc, acc[r]);
    }
    if (mins != nullptr) {
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(qsum[r]), acc[r]);
      mins += kCols;
    }
    codes += kBytes;
    scales += kCols;
    xq += M * Terms * kGroup;
    dx += M * Terms;
    qsum += M;
    nsum128 += M * Terms;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + nb * kCols, acc[r]);
}

// 9 rows would need 27 zmm for sums and results, plus codes, broadcasts and the nibble mask: spills.
constexpr int kMaxRows = 8;
constexpr int64_t kSplitRowsFrom = 16;
constexpr int64_t kSplitRowsMaxWeights = int64_t{1} << 23;

// Blocks nb0..nb1 x rows m0..m1, in tiles of at most kMaxRows rows as even as possible (9 rows:
// 5 + 4, not 8 + 1); a block's codes stay in L1 from one tile to the next.
template <int Bits, int Terms>
TV_TARGET void blocks(const Weights& w, const Acts& a, int64_t m0, int64_t m1, int64_t N, int64_t nb0, int64_t nb1,
                      float* y) {
  const int64_t tiles = (m1 - m0 + kMaxRows - 1) / kMaxRows;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    int64_t m = m0;
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t left = tiles - i, r = (m1 - m + left - 1) / left;
      switch (r) {
        case 8: tile<8, Bits, Terms>(w, a, N, m, nb, y); break;
        case 7: tile<7, Bits, Terms>(w, a, N, m, nb, y); break;
        case 6: tile<6, Bits, Terms>(w, a, N, m, nb, y); break;
        case 5: tile<5, Bits, Terms>(w, a, N, m, nb, y); break;
        case 4: tile<4, Bits, Terms>(w, a, N, m, nb, y); break;
        case 3: tile<3, Bits, Terms>(w, a, N, m, nb, y); break;
        case 2: tile<2, Bits, Terms>(w, a, N, m, nb, y); break;
        default: tile<1, Bits, Terms>(w, a, N, m, nb, y); break;
      }
      m += r;
    }
  }
}

// Rounds rows m0..m1 of x and multiplies them with blocks nb0..nb1 (rows already rounded when
// `round` is false).
template <int Bits, int Terms>
TV_TARGET void run(const float* x, const Weights& w, const Acts& a, int64_t K, int64_t N, int64_t m0, int64_t m1,
                   int64_t nb0, int64_t nb1, bool round, float* y) {
  if (round) quantize_rows<Terms>(x, K, m0, m1, a);
  blocks<Bits, Terms>(w, a, m0, m1, N, nb0, nb1, y);
}

bool vnni_supported() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  }();
  return yes;
#else
  return false;
#endif
}

// Floats of scratch that M rows of K activations take once rounded, in `terms` int8 terms.
inline int64_t acts_floats(int64_t M, int64_t K, int64_t terms) {
  const int64_t groups = M * (K / kGroup);
  return groups * (2 * terms + 1) + (M * terms * K + 3) / 4;
}

// The Acts of M rows of K activations laid out in `base` (acts_floats(M, K, terms) floats).
inline Acts make_acts(float* base, int64_t M, int64_t K, int64_t terms) {
  const int64_t groups = M * (K / kGroup);
  float* dx = base;
  float* qsum = dx + groups * terms;
  int32_t* nsum128 = reinterpret_cast<int32_t*>(qsum + groups);
  int8_t* xq = reinterpret_cast<int8_t*>(nsum128 + groups * terms);
  return Acts{xq, dx, qsum, nsum128, M};
}

// The kernel's view of a blocked weight's tensors, checked against [N, K].
inline Weights check(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t bits, int64_t N,
              int64_t K) {
  TORCH_CHECK(vnni_supported(), "this CPU has no AVX512-VNNI");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(N % kCols == 0 && K % kGroup == 0, "N must be a multiple of 16 and K of 32");
  const int64_t G = K / kGroup;
  TORCH_CHECK(codes.is_contiguous() && codes.numel() == N * K / (bits == 4 ? 2 : 1) && codes.element_size() == 1,
              "codes do not match [N/16, G, ...] for this N and K");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf && scales.numel() == N * G,
              "scales must be float16 [N/16, G, 16]");
  if (mins.numel() > 0) {
    TORCH_CHECK(mins.is_contiguous() && mins.scalar_type() == at::kHalf && mins.numel() == N * G,
                "mins must be float16 [N/16, G, 16] or empty");
  }
  Weights w{};
  w.codes = static_cast<const uint8_t*>(codes.data_ptr());
  w.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  w.mins = mins.numel() > 0 ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  w.G = G;
  w.bits = static_cast<int>(bits);
  return w;
}

}  // namespace
}  // namespace tm_vnni
