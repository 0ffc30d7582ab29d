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
// Blocked layout, per block of 16 output columns (nb) and group of 32 inputs (g): codes uint8
// [N/16, G, bits * 64], quad j (inputs 4 j .. 4 j + 3) holding byte c * 4 + e = code of column
// 16 nb + c at k = 32 g + 4 j + e; int4: zmm t holds quad t in its low nibbles and quad t + 4 in its
// high nibbles; int8: zmm j = quad j, each code stored + 128; scales, mins: fp16 [N/16, G, 16].
// Every GGUF block format is one such layout of its own bits and scales: a block decoder
// (quant_blocks.h) unpacks a group's codes into those quads and gives its sub-block scales, and the
// loops below are written once, templated on the decoder.
//
// Activations are rounded to int8 per group of 32 (scale amax / 127, nearest even), as llama.cpp's
// Q8 activations, and with `terms` = 2 the rounding residual is rounded to int8 again (on steps of
// d2 = d1 / 256, so that the two sums merge in integers): x ~ d1 q1 + d2 q2, about 15 bits per
// activation for 8 more vpdpbusd per group and row. One term measured KL(exact || fast) 0.0028 nats
// and top-1 agreement 97% on held-out text, two terms are within rounding of fp32 activations
// (docs/benchmarks.md). The min term uses the rounded activations' sums so that rounding errors cancel.
// vpdpbusd multiplies unsigned by signed bytes: the codes are the unsigned side (int8 codes stored
// + 128, so the dot product gains 128 * sum(x) per group, which the int32 sums start from:
// no extra bytes per weight).
//
// Where the time goes (Zen 4, 2 threads): from 2 rows on, the vpdpbusd. A zmm vpdpbusd and an fp32
// multiply or FMA share the same two pipes (one zmm op a cycle between them), while integer adds,
// logic and conversions go elsewhere. Per row, group and block the two terms are 16 vpdpbusd, and
// the scaling is 2 more (the merged sum times d2, * scale) plus 1 for the min: ~1.19 cycles per
// vpdpbusd at best (1.25 with the terms scaled apart, when a tile of 8 rows measured ~1.3). So a
// tile keeps each (row, term) int32 sum in a register for the whole group, scales once per group,
// and shares each block's unpacked codes across up to 8 rows. Tiles of 2 or 4 blocks (each
// activation broadcast feeding several vpdpbusd) were no faster with the weights in cache and up to
// 1.5x slower streaming them from memory, as every step does (SmolLM2-135M: 96 MB of weights, 32 MB
// of L3): one block at a time reads the codes front to back.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_isa_cap.h"
#include "blocked_weights.h"
#include "quant_acts.h"
#include "quant_blocks.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

namespace tm_vnni {
namespace {

TV_TARGET TV_INLINE __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The starting value of row r's int32 sum of term t over (half h of) a group, so that codes stored
// + kOffset need no subtraction: -kOffset * the rounded activations' merged sum (quant_acts.h msum),
// on the last term, whose sum the merge takes as it is (0 for formats without offset). One value a
// row, read as it lies: working it out from per-term sums in the tile cost Q5_0 / Q6_K prompts ~15%.
template <class D, int Terms>
TV_INLINE int32_t offset_start(const int32_t* msum, int r, int t, int h) {
  if constexpr (D::kOffset == 0) return 0;
  else if (t != Terms - 1) return 0;
  else return -D::kOffset * msum[r * kMergedSums + (D::kSubs == 1 ? 0 : 1 + h)];
}

// Quads j (lo) and j + 4 (hi) of a group times R rows' activations, into the rows' int32 sums.
template <int R, int Terms, bool TwoChains>
TV_TARGET TV_INLINE void quad_pair(__m512i (&dot)[R][Terms], __m512i (&dot2)[R][Terms], __m512i lo, __m512i hi,
                                   const int8_t* xq, int j) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < Terms; ++t) {
      const int8_t* xp = xq + (r * Terms + t) * kGroup + 4 * j;
      dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], lo, bcast4(xp));
      if constexpr (TwoChains) dot2[r][t] = _mm512_dpbusd_epi32(dot2[r][t], hi, bcast4(xp + 16));
      else dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], hi, bcast4(xp + 16));
    }
}

// A row's int32 sums of its terms as one: D1, or 256 D1 + D2 in units of the second term's step.
template <int Terms>
TV_TARGET TV_INLINE __m512i merged(const __m512i (&d)[Terms]) {
  if constexpr (Terms == 1) return d[0];
  else return _mm512_add_epi32(_mm512_slli_epi32(d[0], 8), d[1]);
}

// Quad J of half H of a group (H = 0: quads 0..3, inputs 0..15; H = 1: quads 4..7): the decoder's pair
// with the other half's unpacking left to the compiler's dead-code elimination.
template <class D, int J, int H>
TV_TARGET TV_INLINE __m512i half_quad(const uint8_t* p) {
  __m512i lo, hi;
  pair<D, J>(p, lo, hi);
  return H == 0 ? lo : hi;
}

// Quad J of half H times R rows' activations, into the rows' int32 sums.
template <class D, int R, int Terms, int H, int J>
TV_TARGET TV_INLINE void half_quad_rows(__m512i (&dot)[R][Terms], const uint8_t* codes, const int8_t* xq) {
  const __m512i c = half_quad<D, J, H>(codes);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < Terms; ++t)
      dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], c, bcast4(xq + (r * Terms + t) * kGroup + 16 * H + 4 * J));
}

// Half H of a group of a format with two sub-blocks a group (Q2_K, Q3_K, Q6_K), R rows: the rows'
// int32 sums over the half's 4 quads, scaled into acc by the half's sub-block scale. Taking the halves
// one after the other needs one set of sums (2 R + R zmm registers), so that tiles hold 8 rows as for
// the other formats, where both halves at once (a second set of sums) allowed 4: each unpacked code
// then feeds 8 rows' vpdpbusd instead of 4, for a second load of the group's codes from L1.
template <class D, int R, int Terms, int H>
TV_TARGET TV_INLINE void half_tile(const uint8_t* codes, const int8_t* xq, const int32_t* msum, const float* dx,
                                   __m512 sc, __m512 (&acc)[R]) {
  __m512i dot[R][Terms];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < Terms; ++t) dot[r][t] = _mm512_set1_epi32(offset_start<D, Terms>(msum, r, t, H));
  half_quad_rows<D, R, Terms, H, 0>(dot, codes, xq);
  half_quad_rows<D, R, Terms, H, 1>(dot, codes, xq);
  half_quad_rows<D, R, Terms, H, 2>(dot, codes, xq);
  half_quad_rows<D, R, Terms, H, 3>(dot, codes, xq);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(merged<Terms>(dot[r])), _mm512_set1_ps(dx[r * Terms + Terms - 1]));
    acc[r] = _mm512_fmadd_ps(s, sc, acc[r]);
  }
}

// One group of R rows with both halves' codes unpacked at once (quads j and j + 4): every format at
// 1-2 rows, and the formats with one sub-block a group at any rows.
template <class D, int R, int Terms>
TV_TARGET TV_INLINE void pair_tile(const uint8_t* codes, const int8_t* xq, const int32_t* msum, const float* dx,
                                   const __m512 (&sc)[D::kSubs], __m512 (&acc)[R]) {
  // With few rows the sums are chains of dependent vpdpbusd (8 a group and term): a second set of
  // sums (quads 4..7) halves the chains; with more rows the rows give the independence, and the
  // registers are needed for them. Two sub-blocks a group need the second set anyway.
  constexpr bool kTwoChains = R <= 2 || D::kSubs == 2;
  __m512i dot[R][Terms], dot2[R][Terms];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < Terms; ++t) {
      dot[r][t] = _mm512_set1_epi32(offset_start<D, Terms>(msum, r, t, 0));
      dot2[r][t] = D::kSubs == 2 ? _mm512_set1_epi32(offset_start<D, Terms>(msum, r, t, 1))
                                 : _mm512_setzero_si512();
    }
  {
    __m512i lo, hi;
    pair<D, 0>(codes, lo, hi);
    quad_pair<R, Terms, kTwoChains>(dot, dot2, lo, hi, xq, 0);
    pair<D, 1>(codes, lo, hi);
    quad_pair<R, Terms, kTwoChains>(dot, dot2, lo, hi, xq, 1);
    pair<D, 2>(codes, lo, hi);
    quad_pair<R, Terms, kTwoChains>(dot, dot2, lo, hi, xq, 2);
    pair<D, 3>(codes, lo, hi);
    quad_pair<R, Terms, kTwoChains>(dot, dot2, lo, hi, xq, 3);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    // The terms' sums merge in integers, 256 D1 + D2 (quant_acts.h: d2 = d1 / 256; |256 D1| < 2^28),
    // and are scaled once by d2: (256 D1 + D2) * d2 * scale is a conversion, a multiply and a
    // multiply-add a row, against two conversions and three for (d1 D1 + d2 D2) * scale.
    const __m512 dxr = _mm512_set1_ps(dx[r * Terms + Terms - 1]);
    if constexpr (D::kSubs == 1) {
      if constexpr (kTwoChains)
        for (int t = 0; t < Terms; ++t) dot[r][t] = _mm512_add_epi32(dot[r][t], dot2[r][t]);
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(merged<Terms>(dot[r])), dxr);
      acc[r] = _mm512_fmadd_ps(s, sc[0], acc[r]);
    } else {
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(merged<Terms>(dot[r])), dxr);
      const __m512 s2 = _mm512_mul_ps(_mm512_cvtepi32_ps(merged<Terms>(dot2[r])), dxr);
      acc[r] = _mm512_fmadd_ps(s2, sc[1], _mm512_fmadd_ps(s, sc[0], acc[r]));
    }
  }
}

// R rows (m0..) x the 16 columns of block nb. Per group, each (row, term) sums its 8 vpdpbusd in an
// int32 register, scaled into the row's fp32 result once: 3 R + 3 zmm registers (R <= 8 of 32).
// Decoders with two sub-blocks a group take the halves in turn from 3 rows (half_tile).
template <class D, int R, int Terms>
TV_TARGET void tile(const Weights& w, const Acts& a, int64_t N, int64_t m0, int64_t nb, float* y) {
  constexpr int64_t kBytes = D::kBits * 64;  // codes of one block and group
  const int64_t G = w.G, M = a.M;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* codes = w.codes + nb * G * kBytes;
  const bool has_min = D::has_min(w);
  const int8_t* xq = a.xq + m0 * Terms * kGroup;
  const float* dx = a.dx + m0 * Terms;
  const float* qsum = a.qsum + m0;
  const float* hqsum = a.hqsum + m0 * 2;
  const int32_t* msum = a.msum + m0 * kMergedSums;
  for (int64_t g = 0; g < G; ++g) {
    // Each group's codes are fetched ahead: with the weights streamed from memory, as in a real step,
    // int4 layers ran ~15% faster at 1-2 rows with 2 kB, and 8-bit ones 1.5x faster at 8 rows (where
    // compute has to overlap the reads). 8-bit codes at 1-2 rows go 4 kB ahead: on a machine whose
    // one core reads ~12 GB/s from memory (docs/benchmarks.md, session 9) the Q8_0 mix's one-row step
    // went from 4.4 to 3.3 ms and Gemma's 168 MB lm_head from ~9.8 to 7.5 ms; a Zen 4 had measured
    // the int8 lm_head ~10% slower with 2 kB there, and 4 kB measured no better at 16-64 rows.
    constexpr int kPrefetchAhead = D::kBits == 8 && R <= 2 ? 4096 : 2048;
#pragma GCC unroll 8
    for (int l = 0; l < kBytes / 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(codes + kPrefetchAhead + l * 64), _MM_HINT_T0);
    fetch_far<D>(w, codes, nb, g);
    __m512 sc[D::kSubs];
    D::scales(w, nb, g, sc);
    if constexpr (D::kSubs == 2 && R > 2) {
      half_tile<D, R, Terms, 0>(codes, xq, msum, dx, sc[0], acc);
      half_tile<D, R, Terms, 1>(codes, xq, msum, dx, sc[1], acc);
    } else {
      pair_tile<D, R, Terms>(codes, xq, msum, dx, sc, acc);
    }
    if (has_min) {
      __m512 mn[D::kSubs];
      D::mins(w, nb, g, mn);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if constexpr (D::kSubs == 1) acc[r] = _mm512_fmadd_ps(mn[0], _mm512_set1_ps(qsum[r]), acc[r]);
        else acc[r] = _mm512_fmadd_ps(mn[1], _mm512_set1_ps(hqsum[2 * r + 1]),
                                      _mm512_fmadd_ps(mn[0], _mm512_set1_ps(hqsum[2 * r]), acc[r]));
      }
    }
    codes += kBytes;
    xq += M * Terms * kGroup;
    dx += M * Terms;
    qsum += M;
    hqsum += M * 2;
    msum += M * kMergedSums;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + nb * kCols, acc[r]);
}

// 9 rows would need 27 zmm for sums and results, plus codes, broadcasts and the nibble mask: spills.
constexpr int kMaxRows = 8;
constexpr int64_t kSplitRowsFrom = 16;
constexpr int64_t kSplitRowsMaxWeights = int64_t{1} << 23;

template <class D>
constexpr int max_rows() { return kMaxRows; }

// Blocks nb0..nb1 x rows m0..m1, in tiles of at most max_rows rows as even as possible (9 rows:
// 5 + 4, not 8 + 1); a block's codes stay in L1 from one tile to the next.
template <class D, int Terms>
TV_TARGET void blocks_of(const Weights& w, const Acts& a, int64_t m0, int64_t m1, int64_t N, int64_t nb0, int64_t nb1,
                         float* y) {
  constexpr int kRows = max_rows<D>();
  const int64_t tiles = (m1 - m0 + kRows - 1) / kRows;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    int64_t m = m0;
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t left = tiles - i, r = (m1 - m + left - 1) / left;
      switch (r) {
        case 8: if constexpr (kRows >= 8) tile<D, 8, Terms>(w, a, N, m, nb, y); break;
        case 7: if constexpr (kRows >= 7) tile<D, 7, Terms>(w, a, N, m, nb, y); break;
        case 6: if constexpr (kRows >= 6) tile<D, 6, Terms>(w, a, N, m, nb, y); break;
        case 5: if constexpr (kRows >= 5) tile<D, 5, Terms>(w, a, N, m, nb, y); break;
        case 4: tile<D, 4, Terms>(w, a, N, m, nb, y); break;
        case 3: tile<D, 3, Terms>(w, a, N, m, nb, y); break;
        case 2: tile<D, 2, Terms>(w, a, N, m, nb, y); break;
        default: tile<D, 1, Terms>(w, a, N, m, nb, y); break;
      }
      m += r;
    }
  }
}

// Blocks nb0..nb1 x rows m0..m1 of a weight of any format.
template <int Terms>
TV_TARGET void blocks(const Weights& w, const Acts& a, int64_t m0, int64_t m1, int64_t N, int64_t nb0, int64_t nb1,
                      float* y) {
  with_decoder(w.fmt, [&]<class D>() { blocks_of<D, Terms>(w, a, m0, m1, N, nb0, nb1, y); });
}


bool vnni_supported() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return tm_isa::allows(tm_isa::kCapAvx512) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  }();
  return yes;
#else
  return false;
#endif
}

// The kernel's view of a blocked weight's tensors in format `fmt`, checked against [N, K].
inline Weights check(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& subs,
                     int64_t fmt, int64_t N, int64_t K) {
  TORCH_CHECK(vnni_supported(), "this CPU has no AVX512-VNNI");
  return check_shapes(codes, scales, mins, subs, fmt, N, K);
}

}  // namespace
}  // namespace tm_vnni
