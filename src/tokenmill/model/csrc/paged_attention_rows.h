#pragma once
// Paged decode attention, one row of one sequence per work item (paged_attention_common.h has the
// layout and the helpers): a vector skeleton for head_dim 16/32/64/128/256 and a plain-loop one for
// any other, each written once over a cache reader R (kv_cache_rows.h).

#include "kv_cache_rows.h"

namespace tm_attention {
namespace {

// What one item touches: query heads h0 .. h0 + heads - 1 of KV head kvh's group, of row `seq`,
// over its visible positions lo .. hi - 1 (lo > 0 under a sliding window or past a cascade's shared
// prefix; hi = len), nv of them, on pages first_page .. num_pages - 1. Scores are indexed by
// position - lo. Part `part` of `parts` (make_plan splits a long row when there are too few items for
// the threads) covers that share of the pages only, cut at page boundaries as runs are.
// `stats`: where its heads' softmax max and sum go (cascade rows), else null.
template <typename R>
struct RowItem {
  using E = typename R::Elem;
  const float* q;  // the first query head's vector
  float* out;
  int64_t len, lo, hi, nv;
  const E* kbase;  // this KV head's rows
  const E* vbase;
  const int64_t* pages;
  int64_t first_page, num_pages;
  float* stats;

  TM_INLINE RowItem(const Args& a, int64_t seq, int64_t kvh, int64_t h0, int64_t part = 0, int64_t parts = 1)
      : q(a.q + (seq * a.num_heads + kvh * a.group + h0) * a.hd),
        out(a.out + (seq * a.num_heads + kvh * a.group + h0) * a.hd),
        len(a.lens[seq]),
        lo(std::max(first_visible(len, a.window), a.starts != nullptr ? a.starts[seq] : int64_t{0})),
        hi(len),
        nv(len - lo),
        kbase(static_cast<const E*>(a.k) + kvh * a.head_stride),
        vbase(static_cast<const E*>(a.v) + kvh * a.head_stride),
        pages(a.table + seq * a.max_pages),
        first_page(lo / a.page_size),
        num_pages((len + a.page_size - 1) / a.page_size),
        stats(a.stats != nullptr ? a.stats + (seq * a.num_heads + kvh * a.group + h0) * 2 : nullptr) {
    if (parts > 1) {
      const int64_t total = num_pages - first_page, p0 = first_page;
      first_page = p0 + total * part / parts;
      num_pages = p0 + total * (part + 1) / parts;
      lo = std::max(lo, first_page * a.page_size);
      hi = std::min(len, num_pages * a.page_size);
      nv = std::max<int64_t>(0, hi - lo);
    }
  }

  // The first row of page p this item reads (past lo on the window's first page).
  TM_INLINE int64_t first_row(int64_t p, int64_t page_size) const { return std::max<int64_t>(0, lo - p * page_size); }
};

// Any head_dim, plain loops the compiler vectorises. `scores` holds group * (len + 1) floats, `acc`
// group * head_dim.
template <typename R>
TM_INLINE void attend_one_scalar(const Args& a, int64_t seq, int64_t kvh, float* __restrict scores,
                                 float* __restrict acc) {
  const RowItem<R> it(a, seq, kvh, 0);
  const int64_t hd = a.hd, group = a.group, len = it.len, page_size = a.page_size, slot_stride = a.slot_stride;
  const int64_t nv = it.nv;
  if (len <= 0) {
    std::fill(it.out, it.out + group * hd, 0.0f);
    return;
  }
  for (int64_t p = it.first_page; p < it.num_pages; ++p) {
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, len - first);
    const typename R::Elem* kpage = it.kbase + it.pages[p] * page_size * slot_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* __restrict qg = it.q + g * hd;
      float* __restrict sg = scores + g * nv + first - it.lo;
      for (int64_t t = it.first_row(p, page_size); t < n; ++t) {
        const typename R::Row krow = R::row(kpage + t * slot_stride);
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < hd; ++d) dot += qg[d] * R::at(krow, d);
        sg[t] = dot * a.scale;
      }
    }
  }
  if (a.softcap > 0.0f) cap_scores(scores, group * nv, a.softcap);
  softmax_rows(scores, group, nv, it.stats);
  std::fill(acc, acc + group * hd, 0.0f);
  for (int64_t p = it.first_page; p < it.num_pages; ++p) {
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, len - first);
    const typename R::Elem* vpage = it.vbase + it.pages[p] * page_size * slot_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* __restrict wg = scores + g * nv + first - it.lo;
      float* __restrict ag = acc + g * hd;
      for (int64_t t = it.first_row(p, page_size); t < n; ++t) {
        const typename R::Row vrow = R::row(vpage + t * slot_stride);
        const float w = wg[t];
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) ag[d] += w * R::at(vrow, d);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = scores[group * nv + g];
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) it.out[g * hd + d] = acc[g * hd + d] * inv;
  }
}

// G query heads of one KV head at once (G known at compile time), head_dim HD, W-float vectors: each
// K and V row is loaded (and widened) once for all G heads that share it, instead of once per head.
// With 3 heads per KV head (SmolLM2) that measured ~1.6x faster at 16 decode rows of ~320 tokens.
// Scores: s[g, pos] = scale * q_g . k_pos, eight positions at a time (one transposing horizontal sum),
// a two-pass softmax, then out[g] = sum_pos e[g, pos] * v_pos in registers, normalised at the end.
// `scores` holds G * (len + 1) floats. With `partial` (an item that is part of its row's pages) each
// head's unnormalised sum, max and sum of weights go there instead, HD + 2 floats a head, for
// merge_parts.
template <typename R, int HD, int W, int G>
TM_INLINE void attend_heads(const Args& a, int64_t seq, int64_t kvh, int64_t h0, const float* __restrict q,
                            float* __restrict scores, int64_t part = 0, int64_t parts = 1,
                            float* __restrict partial = nullptr) {
  constexpr int NC = HD / W;
  using V = Vec<W>;
  using E = typename R::Elem;
  const RowItem<R> it(a, seq, kvh, h0, part, parts);
  const int64_t hi = it.hi, page_size = a.page_size, slot_stride = a.slot_stride, num_pages = it.num_pages;
  const int64_t p0 = it.first_page, nv = it.nv, lo = it.lo;
  if (partial != nullptr && nv <= 0) {  // a part with no position of its own: weighs nothing in the merge
    for (int g = 0; g < G; ++g) {
      std::fill(partial + g * (HD + 2), partial + g * (HD + 2) + HD, 0.0f);
      partial[g * (HD + 2) + HD] = -INFINITY;
      partial[g * (HD + 2) + HD + 1] = 0.0f;
    }
    return;
  }
  if (it.len <= 0) {
    std::fill(it.out, it.out + G * HD, 0.0f);
    return;
  }
  const int64_t page_elems = page_size * slot_stride;
  const int64_t page_bytes = page_span_bytes<R>(page_size, slot_stride, HD);
  auto row_vectors = [&](const E* p, V* x) {
    const typename R::Row r = R::row(p);
    for (int c = 0; c < NC; ++c) x[c] = R::template lanes<W>(r, W * c);
  };

  V qg[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qg[g][c] = loadv<W>(q + g * HD + W * c);

  for (int64_t p = p0; p < std::min(p0 + kPrefetchPages, num_pages); ++p) prefetch_page(it.kbase + it.pages[p] * page_elems, page_bytes);
  for (int64_t p = p0; p < num_pages; ++p) {
    if (p + kPrefetchPages < num_pages) prefetch_page(it.kbase + it.pages[p + kPrefetchPages] * page_elems, page_bytes);
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, hi - first);
    const E* __restrict kpage = it.kbase + it.pages[p] * page_elems;
    float* __restrict sp = scores + first - lo;  // position first + t's score of head g: sp[g * nv + t]
    int64_t t = it.first_row(p, page_size);
    for (; t + 8 <= n; t += 8) {
      V part[G][8];
      for (int i = 0; i < 8; ++i) {
        V k[NC];
        row_vectors(kpage + (t + i) * slot_stride, k);
        for (int g = 0; g < G; ++g) {
          V d = qg[g][0] * k[0];
          for (int c = 1; c < NC; ++c) d += qg[g][c] * k[c];
          part[g][i] = d;
        }
      }
      for (int g = 0; g < G; ++g) storev<8>(sp + g * nv + t, hsum8(part[g]) * a.scale);
    }
    for (; t < n; ++t) {
      V k[NC];
      row_vectors(kpage + t * slot_stride, k);
      for (int g = 0; g < G; ++g) {
        V d = qg[g][0] * k[0];
        for (int c = 1; c < NC; ++c) d += qg[g][c] * k[c];
        sp[g * nv + t] = hsum<W>(d) * a.scale;
      }
    }
  }

  if (a.softcap > 0.0f) cap_scores(scores, G * nv, a.softcap);
  float part_stats[2 * G];
  softmax_rows(scores, G, nv, partial != nullptr ? part_stats : it.stats);

  for (int64_t p = p0; p < std::min(p0 + kPrefetchPages, num_pages); ++p) prefetch_page(it.vbase + it.pages[p] * page_elems, page_bytes);
  V acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = V{};
  for (int64_t p = p0; p < num_pages; ++p) {
    if (p + kPrefetchPages < num_pages) prefetch_page(it.vbase + it.pages[p + kPrefetchPages] * page_elems, page_bytes);
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, hi - first);
    const E* __restrict vpage = it.vbase + it.pages[p] * page_elems;
    const float* __restrict wp = scores + first - lo;
    for (int64_t t = it.first_row(p, page_size); t < n; ++t) {
      V v[NC];
      row_vectors(vpage + t * slot_stride, v);
      for (int g = 0; g < G; ++g) {
        const float w = wp[g * nv + t];
        for (int c = 0; c < NC; ++c) acc[g][c] += w * v[c];
      }
    }
  }
  if (partial != nullptr) {
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < NC; ++c) storev<W>(partial + g * (HD + 2) + W * c, acc[g][c]);
      partial[g * (HD + 2) + HD] = part_stats[2 * g];
      partial[g * (HD + 2) + HD + 1] = part_stats[2 * g + 1];
    }
    return;
  }
  for (int g = 0; g < G; ++g) {
    const float inv = scores[G * nv + g];
    for (int c = 0; c < NC; ++c) storev<W>(it.out + g * HD + W * c, acc[g][c] * inv);
  }
}

// A whole group through attend_heads: up to 4 heads a pass (more would spill the query registers),
// so a group of 6 is two passes of 3 over the rows instead of six of one. At head_dim 256 (Gemma 3)
// a head's query alone is 16 AVX-512 registers: 2 heads a pass. Rows that hold H x (R::kRotated):
// the group's queries are rotated into `qbuf` (group * HD floats) first and its outputs back after
// the passes, here once per item rather than in every pass's instantiation (a part's unnormalised
// sums in `partial` likewise: the rotation is linear, so the merge of rotated-back parts is exact).
template <typename R, int HD, int W>
TM_INLINE void attend_one_vec(const Args& a, int64_t seq, int64_t kvh, float* scores, float* __restrict qbuf,
                              int64_t part = 0, int64_t parts = 1, float* partial = nullptr) {
  constexpr int64_t kMaxHeads = HD >= 256 ? 2 : 4;
  const int64_t group = a.group;
  const int64_t passes = (group + kMaxHeads - 1) / kMaxHeads;
  const int64_t first = (seq * a.num_heads + kvh * group) * HD;
  const float* q = a.q + first;
  if constexpr (R::kRotated) {
    std::memcpy(qbuf, q, static_cast<size_t>(group * HD) * sizeof(float));
    for (int64_t g = 0; g < group; ++g) tm_kv::hadamard<HD>(qbuf + g * HD);
    q = qbuf;
  }
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t h0 = group * pass / passes, heads = group * (pass + 1) / passes - h0;
    const float* qh = q + h0 * HD;
    float* ph = partial != nullptr ? partial + h0 * (HD + 2) : nullptr;
    switch (heads) {
      case 1: attend_heads<R, HD, W, 1>(a, seq, kvh, h0, qh, scores, part, parts, ph); break;
      case 2: attend_heads<R, HD, W, 2>(a, seq, kvh, h0, qh, scores, part, parts, ph); break;
      case 3: if constexpr (kMaxHeads >= 3) attend_heads<R, HD, W, 3>(a, seq, kvh, h0, qh, scores, part, parts, ph); break;
      default: if constexpr (kMaxHeads >= 4) attend_heads<R, HD, W, 4>(a, seq, kvh, h0, qh, scores, part, parts, ph); break;
    }
  }
  if constexpr (R::kRotated) {  // back from H's frame
    for (int64_t g = 0; g < group; ++g) tm_kv::hadamard<HD>(partial != nullptr ? partial + g * (HD + 2) : a.out + first + g * HD);
  }
}

}  // namespace
}  // namespace tm_attention
