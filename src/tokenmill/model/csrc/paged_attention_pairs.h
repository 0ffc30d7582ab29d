#pragma once
// bf16 pair dot products for the run kernel (paged_attention_runs.h), on CPUs with AVX512-BF16.
//
// A run (a prompt chunk's 16 rows, speculative drafts) shares each K/V row among all its rows' query
// heads, so it is bound by multiply-adds, not by reading the cache: a 512-token prompt's attention ran
// at the fp32 FMA ceiling. vdpbf16ps multiplies 16 pairs of bf16 and adds them into 16 fp32 lanes:
// twice the products of an fp32 FMA per instruction. Rows of a bf16 cache are such pairs as they lie
// in the cache (no widening); an int8 code is exact in bf16, so an int8 row is converted once per
// page and its scale applied to the score (K) or folded into the softmax weight (V), in fp32.
// What rounds: q and the softmax weights, to bf16 (as GPU flash attention does); every sum stays
// fp32, and the softmax's maximum and denominator are those of the fp32 scores and weights.
// Only the readers of bf16 and int8 rows (fast mode) take this path; an fp32 cache (exact mode)
// keeps fp32 products.

#include "kv_cache_rows.h"

#include <immintrin.h>

#include <type_traits>

namespace tm_attention {
namespace {

#define TM_PAIRS_TARGET __attribute__((target("arch=x86-64-v4,avx512bf16,prefer-vector-width=512")))

// Pages of V a pass of pair_accumulate covers: its sums are loaded and stored once a chunk. 4 pages of
// 16 rows: 8 kB of interleaved values, in L1 beside the weights.
constexpr int64_t kPairChunkPages = 4;

template <typename Rd>
constexpr bool kPairReader = !std::is_same_v<Rd, F32Rows>;

// q of the run's J query vectors as pairs: qp[dp * JP + j] = bf16(q_j[2 dp]) | bf16(q_j[2 dp + 1]) << 16
// (rounded to nearest even: adjacent floats converted together are such pairs as they lie). Each
// vector is converted 16 values at a time, then its pairs stored down their column of qp. Rotated:
// the pairs of H q_j (rows that hold H x, kv_rotation.h).
template <int HD, bool Rotated>
TM_PAIRS_TARGET void pair_queries(const Args& a, int64_t row0, int64_t kvh, int64_t G, int64_t J, int64_t JP,
                                  uint32_t* __restrict qp) {
  alignas(64) uint32_t pairs[HD / 2];
  alignas(64) float qr[HD];
  for (int64_t j = 0; j < JP; ++j) {
    if (j >= J) {
      for (int dp = 0; dp < HD / 2; ++dp) qp[dp * JP + j] = 0u;
      continue;
    }
    const float* q = a.q + ((row0 + j / G) * a.num_heads + kvh * G + j % G) * HD;
    if constexpr (Rotated) {
      std::memcpy(qr, q, sizeof(qr));
      tm_kv::hadamard<HD>(qr);
      q = qr;
    }
    for (int c = 0; c < HD / 16; ++c) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(q + 16 * c));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs + 8 * c), reinterpret_cast<const __m256i&>(h));
    }
    for (int dp = 0; dp < HD / 2; ++dp) qp[dp * JP + j] = pairs[dp];
  }
}

// Rows t0..n-1 of a page as bf16 pairs, `stride` uint32 apart, and each row's scale: a bf16 cache's
// rows in place (scale 1), an int8 cache's codes converted into buf ([page_size][HD / 2]).
template <typename Rd, int HD>
TM_PAIRS_TARGET const uint32_t* pair_rows(const typename Rd::Elem* page, int64_t slot_stride, int64_t t0,
                                                    int64_t n, uint32_t* __restrict buf, float* __restrict scales,
                                                    int64_t& stride) {
  if constexpr (std::is_same_v<Rd, Bf16Rows>) {
    for (int64_t t = t0; t < n; ++t) scales[t] = 1.0f;
    stride = slot_stride / 2;
    return reinterpret_cast<const uint32_t*>(page);
  } else {
    for (int64_t t = t0; t < n; ++t) {
      const typename Rd::Row row = Rd::row(page + t * slot_stride);
      scales[t] = row.scale;
      for (int c = 0; c < HD / 16; ++c) {
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.codes + 16 * c));
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf + t * (HD / 2) + 8 * c), reinterpret_cast<const __m256i&>(h));
      }
    }
    stride = HD / 2;
    return buf;
  }
}

// Scores of TB positions (t..) times JB vectors of 16 query lanes (from qv): TB x JB independent sums,
// each K value broadcast once for the JB vectors. A vdpbf16ps takes ~6 cycles to feed the next one of
// its chain and two issue a cycle, so 8 chains (one vector of lanes at a time) kept the unit two thirds
// busy; 16-24 keep it full, and a third of the broadcasts.
template <int HD, int TB, int JB>
TM_PAIRS_TARGET void pair_scores_tile(const uint32_t* __restrict rows, int64_t stride, const float* scales, int64_t t,
                                      const uint32_t* __restrict qv, int64_t JP, float scale, float* __restrict st) {
  __m512 acc[TB][JB];
  for (int i = 0; i < TB; ++i)
    for (int b = 0; b < JB; ++b) acc[i][b] = _mm512_setzero_ps();
  for (int dp = 0; dp < HD / 2; ++dp) {
    __m512bh x[JB];
    for (int b = 0; b < JB; ++b) x[b] = (__m512bh)_mm512_loadu_si512(qv + dp * JP + 16 * b);
    for (int i = 0; i < TB; ++i) {
      const __m512bh k = (__m512bh)_mm512_set1_epi32(static_cast<int>(rows[(t + i) * stride + dp]));
      for (int b = 0; b < JB; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], x[b], k);
    }
  }
  for (int i = 0; i < TB; ++i) {
    const __m512 sc = _mm512_set1_ps(scale * scales[t + i]);
    for (int b = 0; b < JB; ++b) _mm512_storeu_ps(st + (t + i) * JP + 16 * b, _mm512_mul_ps(acc[i][b], sc));
  }
}

// pair_scores_tile of TB positions with jb (1-3) vectors of lanes.
template <int HD, int TB>
TM_PAIRS_TARGET void pair_scores_tiles(int64_t jb, const uint32_t* __restrict rows, int64_t stride,
                                       const float* scales, int64_t t, const uint32_t* __restrict qv, int64_t JP,
                                       float scale, float* __restrict st) {
  if (jb == 3) pair_scores_tile<HD, TB, 3>(rows, stride, scales, t, qv, JP, scale, st);
  else if (jb == 2) pair_scores_tile<HD, TB, 2>(rows, stride, scales, t, qv, JP, scale, st);
  else pair_scores_tile<HD, TB, 1>(rows, stride, scales, t, qv, JP, scale, st);
}

// st[t][j] = scale * scales[t] * q_j . k_t for the page's rows t0..n-1 (st: the page's first row), in
// tiles of 8 positions x up to 3 vectors of lanes (2 + 2 for 4: 16 sums, not 24 + 8 with a chain-bound
// tail), the last positions one by one.
template <int HD>
TM_PAIRS_TARGET void pair_scores(const uint32_t* __restrict rows, int64_t stride, const float* scales,
                                 int64_t t0, int64_t n, const uint32_t* __restrict qp, int64_t JP, int64_t JV,
                                 float scale, float* __restrict st) {
  for (int64_t jv = 0; jv < JV;) {
    const int64_t left = JV - jv, jb = left >= 3 && left != 4 ? 3 : std::min<int64_t>(left, 2);
    const uint32_t* qv = qp + jv * 16;
    float* sv = st + jv * 16;
    int64_t t = t0;
    for (; t + 8 <= n; t += 8) pair_scores_tiles<HD, 8>(jb, rows, stride, scales, t, qv, JP, scale, sv);
    for (; t < n; ++t) pair_scores_tiles<HD, 1>(jb, rows, stride, scales, t, qv, JP, scale, sv);
    jv += jb;
  }
}

// The V side of a page's rows t0..n-1 as pair_accumulate takes them, two rows a product: the rows'
// values interleaved into vbuf ([page_size / 2 + 1][HD] uint32, pair tp of the page at row tp) and
// their weights times scales[t] into bf16 pairs written over st's even rows (st: the page's first
// row; its weights are not read again). A row of a pair outside t0..n-1 weighs 0 and reads as 0 (a
// cache slot past a sequence's end may hold anything).
template <int HD>
TM_PAIRS_TARGET void pair_values(const uint32_t* __restrict rows, int64_t stride, const float* scales, int64_t t0,
                                 int64_t n, int64_t JP, int64_t JV, float* __restrict st,
                                 uint32_t* __restrict vbuf) {
  constexpr int NC = HD / 16;
  const int64_t tp0 = t0 / 2, tp1 = (n + 1) / 2;
  // Lane i takes value i of the first row (low half) and value i of the second (high half).
  const __m512i weave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i weave2 = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t tp = tp0; tp < tp1; ++tp) {
    const int64_t ta = 2 * tp, tb = 2 * tp + 1;
    const bool ina = ta >= t0 && ta < n, inb = tb >= t0 && tb < n;
    for (int c = 0; c < NC; ++c) {
      const __m512i va = ina ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + ta * stride + 8 * c)))
                             : _mm512_setzero_si512();
      const __m512i vb = inb ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + tb * stride + 8 * c)))
                             : _mm512_setzero_si512();
      _mm512_storeu_si512(vbuf + tp * HD + 16 * c, _mm512_permutex2var_epi16(va, weave2, vb));
    }
    float* wa = st + ta * JP;
    const float* wb = st + tb * JP;
    const __m512 sa = _mm512_set1_ps(ina ? scales[ta] : 0.0f), sb = _mm512_set1_ps(inb ? scales[tb] : 0.0f);
    for (int64_t jv = 0; jv < JV; ++jv) {
      const __m512 a = ina ? _mm512_mul_ps(_mm512_loadu_ps(wa + 16 * jv), sa) : _mm512_setzero_ps();
      const __m512 b = inb ? _mm512_mul_ps(_mm512_loadu_ps(wb + 16 * jv), sb) : _mm512_setzero_ps();
      const __m512bh h = _mm512_cvtne2ps_pbh(b, a);  // [a_0..a_15 | b_0..b_15]
      _mm512_storeu_si512(wa + 16 * jv, _mm512_permutexvar_epi16(weave, reinterpret_cast<const __m512i&>(h)));
    }
  }
}

// accb[j][d] += sum over pairs tp0..tp1-1 of w[tp][j] . v[tp][d] (pair_values' layout: vbuf rows and
// st's even rows, from the same first position), JB query vectors x CB x 16 values of head_dim a pass,
// their sums in registers across all the pairs: pages are prepared a few at a time (kPairChunkPages)
// so that the sums are loaded and stored once per chunk, not once per page.
template <int HD, int JB, int CB>
TM_PAIRS_TARGET void pair_accumulate(const float* __restrict st, const uint32_t* __restrict vbuf, int64_t tp0,
                                     int64_t tp1, int64_t J, int64_t JP, float* __restrict accb) {
  constexpr int NC = HD / 16;
  for (int64_t j0 = 0; j0 < J; j0 += JB) {
    for (int c0 = 0; c0 < NC; c0 += CB) {
      __m512 acc[JB][CB];
      for (int jj = 0; jj < JB; ++jj)
        for (int c = 0; c < CB; ++c) acc[jj][c] = _mm512_loadu_ps(accb + (j0 + jj) * HD + 16 * (c0 + c));
      for (int64_t tp = tp0; tp < tp1; ++tp) {
        const uint32_t* w = reinterpret_cast<const uint32_t*>(st + 2 * tp * JP) + j0;
        __m512bh v[CB];
        for (int c = 0; c < CB; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vbuf + tp * HD + 16 * (c0 + c));
        for (int jj = 0; jj < JB; ++jj) {
          const __m512bh wj = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[jj]));
          for (int c = 0; c < CB; ++c) acc[jj][c] = _mm512_dpbf16_ps(acc[jj][c], v[c], wj);
        }
      }
      for (int jj = 0; jj < JB; ++jj)
        for (int c = 0; c < CB; ++c) _mm512_storeu_ps(accb + (j0 + jj) * HD + 16 * (c0 + c), acc[jj][c]);
    }
  }
}

}  // namespace
}  // namespace tm_attention
