#pragma once
// Paged decode attention for a run of consecutive rows of one sequence (speculative decoding's
// draft tokens, and fast mode's prompt chunks) as one work item per KV head, over a cache reader
// (kv_cache_rows.h), for head_dim 64, 128 and 256.

#include "kv_cache_rows.h"
#include "paged_attention_pairs.h"

namespace tm_attention {
namespace {

// A run of R consecutive rows of one sequence (speculative decoding sends its draft tokens as
// decode rows): identical block tables and lengths len0, len0 + 1, ..., len0 + R - 1, so row r
// attends to positions 0..len0 + r - 1. One item per (run, KV head) computes all J = R x G query
// vectors (j = r * G + g) like a small matrix product, each K/V page read and widened once:
//  - scores position-major, st[pos][j], one vector of W query vectors per position: Q is
//    transposed once into qt[d][j], and st[pos] = sum_d qt[d] * k[pos][d] (k broadcast), so no
//    horizontal sums and no per-row K loads; the K page is widened to fp32 into kbuf first;
//  - a softmax down each lane, positions past a row's own length masked out (weight 0);
//  - out[j] = sum_pos st[pos][j] * v[pos], four query vectors at a time sharing each V row.
// The kernel is bound by multiply-adds, which per-row items repeat for every row anyway; this
// saves the per-row widening, loads and horizontal sums. Results match the per-row path's to
// float rounding (the dot products are summed in another order).
// Under a sliding window row r sees lo_r = first_visible(len0 + r) .. len0 + r - 1: the item covers
// lo_0 .. lmax - 1 (pages before lo_0's are never touched), and positions some rows do not see (the
// first and the last R - 1 or so) are masked lane by lane, like the lengths.
// With Pairs (the AVX512-BF16 variant) a bf16 or int8 cache's products are bf16 pairs
// (paged_attention_pairs.h): the scores and the weighted sum of V, page by page; the rest is as here.
template <typename Rd, int HD, int W, bool Pairs = false>
TM_INLINE void attend_run_items(const Args& a, int64_t row0, int64_t R, int64_t kvh, int64_t part, int64_t parts,
                                float* __restrict partial, float* __restrict scratch) {
  using V = Vec<W>;
  constexpr int NC = HD / W;
  constexpr int JB = 4;  // query vectors per pass of the weighted V sum
  // Vectors of head_dim per pass of that sum: JB x CB sums, CB values and the weight in registers
  // (AVX-512: 16 + 4 + 1 of 32; AVX2: 8 + 2 + 1 of 16). 8 vectors a pass (head_dim 128 and 256 at
  // W = 16) needed 41 and spilled in the inner loop.
  constexpr int kSumVectors = W == 16 ? 4 : 2;
  constexpr int CB = NC < kSumVectors ? NC : kSumVectors;
  const int64_t G = a.group;
  const int64_t J = R * G;
  const int64_t JV = (J + W - 1) / W;  // vectors of query lanes
  const int64_t JP = JV * W;  // padded lane count: the row length of st and qt
  const int64_t len0 = a.lens[row0];
  const int64_t lmax = len0 + R - 1;
  const int64_t page_size = a.page_size;
  const int64_t slot_stride = a.slot_stride;
  const float scale = a.scale;
  using E = typename Rd::Elem;
  const E* kbase = static_cast<const E*>(a.k) + kvh * a.head_stride;
  const E* vbase = static_cast<const E*>(a.v) + kvh * a.head_stride;
  const int64_t* pages = a.table + (row0 + R - 1) * a.max_pages;
  const int64_t window = a.window;
  const int64_t lo0 = first_visible(len0, window);  // the first position any row sees
  const int64_t first_page = lo0 / page_size;
  const int64_t total_pages = (lmax + page_size - 1) / page_size - first_page;
  // This item's share of the visible pages: all of them, or part `part` of `parts` (see make_plan).
  const int64_t page0 = first_page + total_pages * part / parts;
  const int64_t num_pages = first_page + total_pages * (part + 1) / parts - page0;
  pages += page0;
  const int64_t base = page0 * page_size;  // the position of this item's first page's first row
  const int64_t start = std::max(base, lo0);  // the first position this item reads
  const int64_t end = std::min(lmax, base + num_pages * page_size);
  const int64_t page_elems = page_size * slot_stride;
  const int64_t page_bytes = page_span_bytes<Rd>(page_size, slot_stride, HD);

  float* __restrict st = scratch;  // [end - base][JP], row t - base for position t
  float* __restrict qt = st + lmax * JP;  // [HD][JP]
  float* __restrict accb = qt + HD * JP;  // [JP][HD]
  float* __restrict stat = accb + JP * HD;  // [2][JP]: max, then 1 / sum
  float* __restrict kbuf = stat + 2 * JP;  // [page_size][HD]
  constexpr bool kPairs = Pairs && W == 16 && kPairReader<Rd>;
  // Pairs: an int8 page's rows as bf16 pairs in kbuf's first half, the page's row scales after them,
  // then V's interleaved rows of up to kPairChunkPages pages.
  uint32_t* __restrict pair_buf = reinterpret_cast<uint32_t*>(kbuf);
  float* __restrict row_scales = kbuf + page_size * HD / 2;
  uint32_t* __restrict vbuf = reinterpret_cast<uint32_t*>(row_scales + page_size);
  if constexpr (kPairs) {
    pair_queries<HD, Rd::kRotated>(a, row0, kvh, G, J, JP, reinterpret_cast<uint32_t*>(qt));
  } else {
    alignas(64) float qr[HD];
    for (int64_t j = 0; j < JP; ++j) {
      const float* q = a.q + ((row0 + j / G) * a.num_heads + kvh * G + j % G) * HD;
      if constexpr (Rd::kRotated) {  // H q: the frame the rows are stored in
        if (j < J) {
          std::memcpy(qr, q, sizeof(qr));
          tm_kv::hadamard<HD>(qr);
          q = qr;
        }
      }
      for (int d = 0; d < HD; ++d) qt[d * JP + j] = j < J ? q[d] : 0.0f;
    }
  }

  auto widen = [&](const E* src, int64_t t0, int64_t n) {  // the page's rows t0..n-1 as fp32, [n][HD]
    for (int64_t t = t0; t < n; ++t) {
      const typename Rd::Row row = Rd::row(src + t * slot_stride);
      for (int c = 0; c < NC; ++c) storev<W>(kbuf + t * HD + W * c, Rd::template lanes<W>(row, W * c));
    }
  };

  for (int64_t p = 0; p < std::min(kPrefetchPages, num_pages); ++p) prefetch_page(kbase + pages[p] * page_elems, page_bytes);
  for (int64_t p = 0; p < num_pages; ++p) {
    if (p + kPrefetchPages < num_pages) prefetch_page(kbase + pages[p + kPrefetchPages] * page_elems, page_bytes);
    const int64_t first = p * page_size;  // relative to base
    const int64_t n = std::min(page_size, end - base - first);
    const int64_t t0 = std::max<int64_t>(0, start - base - first);
    if constexpr (kPairs) {
      int64_t stride = 0;
      const uint32_t* rows = pair_rows<Rd, HD>(kbase + pages[p] * page_elems, slot_stride, t0, n, pair_buf, row_scales, stride);
      pair_scores<HD>(rows, stride, row_scales, t0, n, reinterpret_cast<const uint32_t*>(qt), JP, JV, scale, st + first * JP);
      continue;
    }
    widen(kbase + pages[p] * page_elems, t0, n);
    for (int64_t jv = 0; jv < JV; ++jv) {
      const float* __restrict qv = qt + jv * W;
      float* __restrict sv = st + first * JP + jv * W;
      int64_t t = t0;
      for (; t + 8 <= n; t += 8) {
        V acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = V{};
        for (int d = 0; d < HD; ++d) {
          const V x = loadv<W>(qv + d * JP);
          for (int i = 0; i < 8; ++i) acc[i] += x * kbuf[(t + i) * HD + d];
        }
        for (int i = 0; i < 8; ++i) storev<W>(sv + (t + i) * JP, acc[i] * scale);
      }
      for (; t < n; ++t) {
        V acc = V{};
        for (int d = 0; d < HD; ++d) acc += loadv<W>(qv + d * JP) * kbuf[t * HD + d];
        storev<W>(sv + t * JP, acc * scale);
      }
    }
  }

  if (a.softcap > 0.0f) cap_scores(st + (start - base) * JP, (end - start) * JP, a.softcap);

  // Softmax down each lane j over the positions its row sees, of those this item covers, W lanes at
  // a time where every row sees them ([full_lo, full_hi)); the few others lane by lane, a position
  // a lane does not see weighing 0. A lane with none of its positions here keeps max -inf, sum 0.
  float* __restrict sum = stat + JP;
  const int64_t full_lo = std::max(start, first_visible(lmax, window));
  const int64_t full_hi = std::max(full_lo, std::min(end, len0));
  // f(j, len) for each lane j and the length of its row, j / G (pad lanes: as if further rows), with no
  // division in the loop: the edges run it for ~2 R positions of every item, and an integer division a
  // lane and position cost as much as the item's softmax.
  auto lanes = [&](auto&& f) {
    for (int64_t j0 = 0, len = len0; j0 < JP; j0 += G, ++len)
      for (int64_t j = j0; j < std::min(JP, j0 + G); ++j) f(j, len);
  };
  auto sees = [&](int64_t len, int64_t t) { return t < len && t >= first_visible(len, window); };
  auto edges = [&](auto&& f) {  // f(t) for the positions outside [full_lo, full_hi)
    for (int64_t t = start; t < std::min(full_lo, end); ++t) f(t);
    for (int64_t t = full_hi; t < end; ++t) f(t);
  };
  for (int64_t jv = 0; jv < JV; ++jv) {
    V m = V{} - INFINITY;
    for (int64_t t = full_lo; t < full_hi; ++t) {
      const V x = loadv<W>(st + (t - base) * JP + jv * W);
      m = x > m ? x : m;
    }
    storev<W>(stat + jv * W, m);
  }
  edges([&](int64_t t) {
    const float* __restrict s = st + (t - base) * JP;
    lanes([&](int64_t j, int64_t len) {
      if (sees(len, t)) stat[j] = s[j] > stat[j] ? s[j] : stat[j];
    });
  });
  for (int64_t jv = 0; jv < JV; ++jv) {
    const V m = loadv<W>(stat + jv * W);
    V total = V{};
    for (int64_t t = full_lo; t < full_hi; ++t) {
      float* x = st + (t - base) * JP + jv * W;
      const V e = exp_nonpos_v<W>(loadv<W>(x) - m);
      storev<W>(x, e);
      total += e;
    }
    storev<W>(sum + jv * W, total);
  }
  edges([&](int64_t t) {
    float* __restrict s = st + (t - base) * JP;
    lanes([&](int64_t j, int64_t len) {
      if (!sees(len, t)) {
        s[j] = 0.0f;
        return;
      }
      s[j] = exp_nonpos(s[j] - stat[j]);
      sum[j] += s[j];
    });
  });

  std::fill(accb, accb + JP * HD, 0.0f);
  for (int64_t p = 0; p < std::min(kPrefetchPages, num_pages); ++p) prefetch_page(vbase + pages[p] * page_elems, page_bytes);
  for (int64_t p = 0; p < num_pages; ++p) {
    if (p + kPrefetchPages < num_pages) prefetch_page(vbase + pages[p + kPrefetchPages] * page_elems, page_bytes);
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, end - base - first);
    const int64_t t0 = std::max<int64_t>(0, start - base - first);
    if constexpr (kPairs) {
      // Pages a chunk at a time (an odd page size pairs rows across pages: one at a time then), each
      // prepared into its place in vbuf, then multiplied in one pass (pair_accumulate).
      const int64_t chunk = page_size % 2 == 0 ? kPairChunkPages : 1, half = page_size / 2;
      const int64_t last = std::min(num_pages, p + chunk) - 1;
      for (int64_t c = p; c <= last; ++c) {
        if (c > p && c + kPrefetchPages < num_pages) prefetch_page(vbase + pages[c + kPrefetchPages] * page_elems, page_bytes);
        const int64_t cf = c * page_size, cn = std::min(page_size, end - base - cf);
        const int64_t ct0 = std::max<int64_t>(0, start - base - cf);
        int64_t stride = 0;
        const uint32_t* rows = pair_rows<Rd, HD>(vbase + pages[c] * page_elems, slot_stride, ct0, cn, pair_buf, row_scales, stride);
        pair_values<HD>(rows, stride, row_scales, ct0, cn, JP, JV, st + cf * JP, vbuf + (c - p) * half * HD);
      }
      const int64_t last_n = std::min(page_size, end - base - last * page_size);
      pair_accumulate<HD, JB, CB>(st + first * JP, vbuf, t0 / 2, (last - p) * half + (last_n + 1) / 2, J, JP, accb);
      p = last;
      continue;
    }
    widen(vbase + pages[p] * page_elems, t0, n);
    for (int64_t j0 = 0; j0 < J; j0 += JB) {
      for (int c0 = 0; c0 < NC; c0 += CB) {
        V acc[JB][CB];
        for (int jj = 0; jj < JB; ++jj)
          for (int c = 0; c < CB; ++c) acc[jj][c] = loadv<W>(accb + (j0 + jj) * HD + W * (c0 + c));
        for (int64_t t = t0; t < n; ++t) {
          const float* __restrict s = st + (first + t) * JP + j0;
          V v[CB];
          for (int c = 0; c < CB; ++c) v[c] = loadv<W>(kbuf + t * HD + W * (c0 + c));
          for (int jj = 0; jj < JB; ++jj) {
            const float w = s[jj];
            for (int c = 0; c < CB; ++c) acc[jj][c] += w * v[c];
          }
        }
        for (int jj = 0; jj < JB; ++jj)
          for (int c = 0; c < CB; ++c) storev<W>(accb + (j0 + jj) * HD + W * (c0 + c), acc[jj][c]);
      }
    }
  }
  // Back from H's frame; before the split runs' merge too, which is linear in these sums.
  if constexpr (Rd::kRotated)
    for (int64_t j = 0; j < J; ++j) tm_kv::hadamard<HD>(accb + j * HD);
  if (partial != nullptr) {  // [J][HD + 2]: the unnormalised sum, the max, the sum of weights
    for (int64_t j = 0; j < J; ++j) {
      float* __restrict pj = partial + j * (HD + 2);
      for (int c = 0; c < NC; ++c) storev<W>(pj + W * c, loadv<W>(accb + j * HD + W * c));
      pj[HD] = stat[j];
      pj[HD + 1] = sum[j];
    }
    return;
  }
  for (int64_t j = 0; j < J; ++j) {
    float* __restrict out = a.out + ((row0 + j / G) * a.num_heads + kvh * G + j % G) * HD;
    const float inv = 1.0f / sum[j];
    for (int c = 0; c < NC; ++c) storev<W>(out + W * c, loadv<W>(accb + j * HD + W * c) * inv);
  }
}

// Scratch floats attend_run_items needs (for any W up to 16).
inline int64_t run_scratch(int64_t rows, int64_t group, int64_t len_last, int64_t hd, int64_t page_size) {
  const int64_t jp = (rows * group + 15) / 16 * 16;
  // + the pair path's odd row and scales, and its chunk of interleaved V pages
  return jp * (len_last + 2 + 2 * hd) + page_size * hd + hd + page_size + (kPairChunkPages - 1) * page_size * hd / 2;
}

}  // namespace
}  // namespace tm_attention
