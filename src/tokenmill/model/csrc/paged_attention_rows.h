#pragma once
// Paged decode attention, one row of one sequence per work item (paged_attention_common.h has the
// layout and the helpers): vector loops per head_dim, and the query-head group unrolled.

#include "paged_attention_common.h"

namespace tm_attention {
namespace {

template <typename T, int HD, int W>
TM_INLINE void attend_one_vec(const Args& a, int64_t seq, int64_t kvh, float* __restrict scores) {
  constexpr int NC = HD / W;
  using V = Vec<W>;
  const int64_t group = a.group;
  const int64_t len = a.lens[seq];
  const int64_t page_size = a.page_size;
  const int64_t slot_stride = a.slot_stride;
  const float scale = a.scale;
  const float* __restrict q = a.q + (seq * a.num_heads + kvh * group) * HD;
  float* __restrict out = a.out + (seq * a.num_heads + kvh * group) * HD;
  if (len <= 0) {
    std::fill(out, out + group * HD, 0.0f);
    return;
  }
  const T* kbase = static_cast<const T*>(a.k) + kvh * a.head_stride;
  const T* vbase = static_cast<const T*>(a.v) + kvh * a.head_stride;
  const int64_t* pages = a.table + seq * a.max_pages;
  const int64_t num_pages = (len + page_size - 1) / page_size;
  const int64_t page_elems = page_size * slot_stride;
  // Bytes spanned by a page's rows for this head (rows are slot_stride apart; HD of each is read).
  const int64_t page_bytes = ((page_size - 1) * slot_stride + HD) * static_cast<int64_t>(sizeof(T));

  // Scores: s[g, pos] = scale * q_g . k_pos, eight positions at a time.
  for (int64_t p = 0; p < std::min(kPrefetchPages, num_pages); ++p) {
    prefetch_page(kbase + pages[p] * page_elems, page_bytes);
  }
  for (int64_t p = 0; p < num_pages; ++p) {
    if (p + kPrefetchPages < num_pages) prefetch_page(kbase + pages[p + kPrefetchPages] * page_elems, page_bytes);
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, len - first);
    const T* __restrict kpage = kbase + pages[p] * page_elems;
    for (int64_t g = 0; g < group; ++g) {
      V qg[NC];
      for (int c = 0; c < NC; ++c) qg[c] = loadv<W>(q + g * HD + W * c);
      float* __restrict sg = scores + g * len + first;
      int64_t t = 0;
      for (; t + 8 <= n; t += 8) {
        V dots[8];
        for (int i = 0; i < 8; ++i) {
          const T* krow = kpage + (t + i) * slot_stride;
          V d = qg[0] * loadv<W>(krow);
          for (int c = 1; c < NC; ++c) d += qg[c] * loadv<W>(krow + W * c);
          dots[i] = d;
        }
        storev<8>(sg + t, hsum8(dots) * scale);
      }
      for (; t < n; ++t) {
        const T* krow = kpage + t * slot_stride;
        V d = qg[0] * loadv<W>(krow);
        for (int c = 1; c < NC; ++c) d += qg[c] * loadv<W>(krow + W * c);
        sg[t] = hsum<W>(d) * scale;
      }
    }
  }

  softmax_rows(scores, group, len);

  // out[g] = sum_pos e[g, pos] * v_pos, accumulated in registers page by page, then normalised.
  for (int64_t p = 0; p < std::min(kPrefetchPages, num_pages); ++p) {
    prefetch_page(vbase + pages[p] * page_elems, page_bytes);
  }
  std::fill(out, out + group * HD, 0.0f);
  for (int64_t p = 0; p < num_pages; ++p) {
    if (p + kPrefetchPages < num_pages) prefetch_page(vbase + pages[p + kPrefetchPages] * page_elems, page_bytes);
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, len - first);
    const T* __restrict vpage = vbase + pages[p] * page_elems;
    for (int64_t g = 0; g < group; ++g) {
      const float* __restrict wg = scores + g * len + first;
      // Two accumulator sets (even and odd positions): twice the independent FMA chains.
      V acc[NC], acc2[NC];
      for (int c = 0; c < NC; ++c) {
        acc[c] = loadv<W>(out + g * HD + W * c);
        acc2[c] = V{};
      }
      int64_t t = 0;
      for (; t + 2 <= n; t += 2) {
        const T* vrow = vpage + t * slot_stride;
        const float w0 = wg[t], w1 = wg[t + 1];
        for (int c = 0; c < NC; ++c) {
          acc[c] += w0 * loadv<W>(vrow + W * c);
          acc2[c] += w1 * loadv<W>(vrow + slot_stride + W * c);
        }
      }
      if (t < n) {
        const T* vrow = vpage + t * slot_stride;
        for (int c = 0; c < NC; ++c) acc[c] += wg[t] * loadv<W>(vrow + W * c);
      }
      for (int c = 0; c < NC; ++c) storev<W>(out + g * HD + W * c, acc[c] + acc2[c]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = scores[group * len + g];
    for (int c = 0; c < NC; ++c) storev<W>(out + g * HD + W * c, loadv<W>(out + g * HD + W * c) * inv);
  }
}


// The same attention with the query-head group size G known at compile time and the loops turned
// around: each K and V row is loaded (and widened from bf16) once for all G query heads that share
// it, instead of once per head. With 3 heads per KV head (SmolLM2) that measured ~1.6x faster at 16
// decode rows of ~320 tokens.
template <typename T, int HD, int W, int G>
TM_INLINE void attend_one_grouped(const Args& a, int64_t seq, int64_t kvh, float* __restrict scores) {
  constexpr int NC = HD / W;
  using V = Vec<W>;
  const int64_t len = a.lens[seq];
  const int64_t page_size = a.page_size;
  const int64_t slot_stride = a.slot_stride;
  const float scale = a.scale;
  const float* __restrict q = a.q + (seq * a.num_heads + kvh * G) * HD;
  float* __restrict out = a.out + (seq * a.num_heads + kvh * G) * HD;
  if (len <= 0) {
    std::fill(out, out + G * HD, 0.0f);
    return;
  }
  const T* kbase = static_cast<const T*>(a.k) + kvh * a.head_stride;
  const T* vbase = static_cast<const T*>(a.v) + kvh * a.head_stride;
  const int64_t* pages = a.table + seq * a.max_pages;
  const int64_t num_pages = (len + page_size - 1) / page_size;
  const int64_t page_elems = page_size * slot_stride;
  const int64_t page_bytes = ((page_size - 1) * slot_stride + HD) * static_cast<int64_t>(sizeof(T));

  V qg[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qg[g][c] = loadv<W>(q + g * HD + W * c);

  for (int64_t p = 0; p < std::min(kPrefetchPages, num_pages); ++p) {
    prefetch_page(kbase + pages[p] * page_elems, page_bytes);
  }
  for (int64_t p = 0; p < num_pages; ++p) {
    if (p + kPrefetchPages < num_pages) prefetch_page(kbase + pages[p + kPrefetchPages] * page_elems, page_bytes);
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, len - first);
    const T* __restrict kpage = kbase + pages[p] * page_elems;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      V part[G][8];
      for (int i = 0; i < 8; ++i) {
        const T* krow = kpage + (t + i) * slot_stride;
        V k[NC];
        for (int c = 0; c < NC; ++c) k[c] = loadv<W>(krow + W * c);
        for (int g = 0; g < G; ++g) {
          V d = qg[g][0] * k[0];
          for (int c = 1; c < NC; ++c) d += qg[g][c] * k[c];
          part[g][i] = d;
        }
      }
      for (int g = 0; g < G; ++g) storev<8>(scores + g * len + first + t, hsum8(part[g]) * scale);
    }
    for (; t < n; ++t) {
      const T* krow = kpage + t * slot_stride;
      V k[NC];
      for (int c = 0; c < NC; ++c) k[c] = loadv<W>(krow + W * c);
      for (int g = 0; g < G; ++g) {
        V d = qg[g][0] * k[0];
        for (int c = 1; c < NC; ++c) d += qg[g][c] * k[c];
        scores[g * len + first + t] = hsum<W>(d) * scale;
      }
    }
  }

  softmax_rows(scores, G, len);

  for (int64_t p = 0; p < std::min(kPrefetchPages, num_pages); ++p) {
    prefetch_page(vbase + pages[p] * page_elems, page_bytes);
  }
  V acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = V{};
  for (int64_t p = 0; p < num_pages; ++p) {
    if (p + kPrefetchPages < num_pages) prefetch_page(vbase + pages[p + kPrefetchPages] * page_elems, page_bytes);
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, len - first);
    const T* __restrict vpage = vbase + pages[p] * page_elems;
    for (int64_t t = 0; t < n; ++t) {
      const T* vrow = vpage + t * slot_stride;
      V v[NC];
      for (int c = 0; c < NC; ++c) v[c] = loadv<W>(vrow + W * c);
      for (int g = 0; g < G; ++g) {
        const float w = scores[g * len + first + t];
        for (int c = 0; c < NC; ++c) acc[g][c] += w * v[c];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = scores[G * len + g];
    for (int c = 0; c < NC; ++c) storev<W>(out + g * HD + W * c, acc[g][c] * inv);
  }
}

template <typename T, int HD, int W>
TM_INLINE bool attend_grouped(const Args& a, int64_t seq, int64_t kvh, float* scores) {
  switch (a.group) {
    case 1: attend_one_grouped<T, HD, W, 1>(a, seq, kvh, scores); return true;
    case 2: attend_one_grouped<T, HD, W, 2>(a, seq, kvh, scores); return true;
    case 3: attend_one_grouped<T, HD, W, 3>(a, seq, kvh, scores); return true;
    case 4: attend_one_grouped<T, HD, W, 4>(a, seq, kvh, scores); return true;
    default: return false;
  }
}

// exp_nonpos on W lanes (the same steps).

}  // namespace
}  // namespace tm_attention
