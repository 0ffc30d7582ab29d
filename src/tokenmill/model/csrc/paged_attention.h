#pragma once
// Fused paged-attention decode for CPU: one query token per sequence, K/V read straight from the
// page pool through the block table (no gather into padded tensors, no mask).
//
// Cache layout (see tokenmill/model/attention.py): k_cache, v_cache [num_kv_heads, num_slots, head_dim],
// head-major, slot = page * page_size + offset; float32 or bfloat16 (read as bf16, computed in fp32).
// Query heads that share a KV head are adjacent (HF's repeat_kv order): query head h uses KV head
// h / group.
//
// Consecutive rows of one sequence (speculative decoding's draft tokens: same block table, lengths
// +1 each) are detected and computed together, see attend_run_items.
//
// Work item = (sequence, KV head), spread over threads with at::parallel_for. Each item computes,
// for the `group` query heads of that KV head: scores over positions 0..len-1, walking the block
// table page by page; a two-pass softmax in fp32 (max subtracted); the probability-weighted sum of
// the V rows, normalised at the end.
//
// The binary must not depend on the CPU it was built on (no -march=native; the build is cached and
// may be shared): the kernel is compiled three times with GCC target attributes, x86-64-v4
// (AVX-512), x86-64-v3 (AVX2 + FMA) and baseline, and the widest the CPU supports is picked at run
// time. The hot loops use GCC vector extensions (head_dim 16/32/64/128), other head dims plain
// loops that the compiler auto-vectorises.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "exp_approx.h"

namespace tm_attention {
namespace {

using tm_math::exp_nonpos;

#define TM_INLINE inline __attribute__((always_inline))

TM_INLINE float load_f(const float* p, int64_t i) { return p[i]; }
TM_INLINE float load_f(const uint16_t* p, int64_t i) {  // bf16 -> fp32 is a 16-bit shift
  return std::bit_cast<float>(static_cast<uint32_t>(p[i]) << 16);
}

struct Args {
  const float* q;  // [nd, num_heads, hd]
  const void* k;
  const void* v;
  int64_t head_stride;  // elements between KV heads in the caches
  int64_t slot_stride;  // elements between slots
  const int64_t* table;  // [nd, max_pages]
  const int64_t* lens;  // [nd]
  int64_t max_pages;
  int64_t page_size;
  int64_t num_heads;
  int64_t kv_heads;
  int64_t group;
  int64_t hd;
  float scale;
  float* out;  // [nd, num_heads, hd]
  // Work items, kItemFields each: first row, rows (> 1: a run of one sequence's consecutive rows,
  // see attend_run_items), KV head, part, parts (a run's pages may be split between items), and the
  // offset of the item's partial results in `partial` (parts > 1 only).
  const int64_t* items;
  float* partial;
};

// Softmax numerators of the scores s[g, 0..len-1] in place (not normalised), and 1 / their sum in
// s[group * len + g].
TM_INLINE void softmax_rows(float* __restrict scores, int64_t group, int64_t len) {
  for (int64_t g = 0; g < group; ++g) {
    float* __restrict sg = scores + g * len;
    float m = sg[0];
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < len; ++i) m = sg[i] > m ? sg[i] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < len; ++i) {
      const float e = exp_nonpos(sg[i] - m);
      sg[i] = e;
      sum += e;
    }
    scores[group * len + g] = 1.0f / sum;
  }
}

// One (sequence, KV head) item with plain loops, for any head_dim. `scores` holds
// group * (len + 1) floats, `acc` group * head_dim.
template <typename T>
TM_INLINE void attend_one_scalar(const Args& a, int64_t seq, int64_t kvh, float* __restrict scores,
                                 float* __restrict acc) {
  const int64_t hd = a.hd;
  const int64_t group = a.group;
  const int64_t len = a.lens[seq];
  const int64_t page_size = a.page_size;
  const int64_t slot_stride = a.slot_stride;
  const float scale = a.scale;
  const float* __restrict q = a.q + (seq * a.num_heads + kvh * group) * hd;
  float* __restrict out = a.out + (seq * a.num_heads + kvh * group) * hd;
  if (len <= 0) {
    std::fill(out, out + group * hd, 0.0f);
    return;
  }
  const T* kbase = static_cast<const T*>(a.k) + kvh * a.head_stride;
  const T* vbase = static_cast<const T*>(a.v) + kvh * a.head_stride;
  const int64_t* pages = a.table + seq * a.max_pages;
  const int64_t num_pages = (len + page_size - 1) / page_size;

  for (int64_t p = 0; p < num_pages; ++p) {
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, len - first);
    const T* __restrict kpage = kbase + pages[p] * page_size * slot_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* __restrict qg = q + g * hd;
      float* __restrict sg = scores + g * len + first;
      for (int64_t t = 0; t < n; ++t) {
        const T* __restrict krow = kpage + t * slot_stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < hd; ++d) dot += qg[d] * load_f(krow, d);
        sg[t] = dot * scale;
      }
    }
  }
  softmax_rows(scores, group, len);
  std::fill(acc, acc + group * hd, 0.0f);
  for (int64_t p = 0; p < num_pages; ++p) {
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, len - first);
    const T* __restrict vpage = vbase + pages[p] * page_size * slot_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* __restrict wg = scores + g * len + first;
      float* __restrict ag = acc + g * hd;
      for (int64_t t = 0; t < n; ++t) {
        const T* __restrict vrow = vpage + t * slot_stride;
        const float w = wg[t];
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) ag[d] += w * load_f(vrow, d);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = scores[group * len + g];
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) out[g * hd + d] = acc[g * hd + d] * inv;
  }
}

// ---- Vector path: head_dim 16, 32, 64 or 128 ---------------------------------------------------
// GCC vector extensions of W floats: W = 16 (one zmm) in the AVX-512 variant, W = 8 (one ymm, or two
// xmm on baseline x86-64) in the others. The same source serves every variant.

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef int32_t v8i __attribute__((vector_size(32)));

template <int W>
struct VecT;
template <>
struct VecT<16> {
  using type = v16f;
};
template <>
struct VecT<8> {
  using type = v8f;
};
template <int W>
using Vec = typename VecT<W>::type;

template <int W>
TM_INLINE Vec<W> loadv(const float* p) {
  Vec<W> x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <int W>
TM_INLINE Vec<W> loadv(const uint16_t* p) {  // bf16 -> fp32: widen and shift into the high half
  if constexpr (W == 16) {
    v16h h;
    std::memcpy(&h, p, sizeof(h));
    return reinterpret_cast<v16f>(__builtin_convertvector(h, v16u) << 16);
  } else {
    v8h h;
    std::memcpy(&h, p, sizeof(h));
    return reinterpret_cast<v8f>(__builtin_convertvector(h, v8u) << 16);
  }
}
template <int W>
TM_INLINE void storev(float* p, Vec<W> x) {
  std::memcpy(p, &x, sizeof(x));
}

// Lane i of the result is the sum of the lanes of x[i], i < 8: a transposing tree of shuffles and
// adds, ~3 operations per sum instead of ~8 for reducing each vector on its own.
TM_INLINE v8f hsum8(const v16f* x) {
  v16f z[4];
  for (int i = 0; i < 4; ++i) {
    const v16f a = x[2 * i], b = x[2 * i + 1];
    z[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  v16f y[2];
  for (int j = 0; j < 2; ++j) {
    const v16f a = z[2 * j], b = z[2 * j + 1];
    y[j] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  const v16f w = __builtin_shufflevector(y[0], y[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                 __builtin_shufflevector(y[0], y[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(w, w, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(w, w, 1, 3, 5, 7, 9, 11, 13, 15);
}
TM_INLINE v8f hsum8(const v8f* x) {
  v8f z[4];
  for (int i = 0; i < 4; ++i) {
    const v8f a = x[2 * i], b = x[2 * i + 1];
    z[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  v8f y[2];
  for (int j = 0; j < 2; ++j) {
    const v8f a = z[2 * j], b = z[2 * j + 1];
    y[j] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

template <int W>
TM_INLINE float hsum(Vec<W> x) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += x[i];
  return s;
}

// Prefetch a page of K or V rows into L2 (prefetcht1: measured clearly faster than into L1 here).
TM_INLINE void prefetch_page(const void* p, int64_t n_bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < n_bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

// Pages are read this far ahead: a sequence's pages lie anywhere in the pool, where the hardware
// prefetchers cannot follow (measured ~1.6x faster than no software prefetch on random tables).
constexpr int64_t kPrefetchPages = 4;

// Longest run of one sequence's rows computed as one work item (the runner sends at most 16).
constexpr int64_t kMaxRunRows = 16;
constexpr int64_t kItemFields = 6;

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
template <int W>
TM_INLINE Vec<W> exp_nonpos_v(Vec<W> x) {
  using V = Vec<W>;
  using VI = std::conditional_t<W == 16, v16i, v8i>;
  const V lowest = V{} - 87.0f;
  x = x < lowest ? lowest : x;
  const V shifter = V{} + 12582912.0f;
  const V t = x * 1.44269504088896341f + shifter;
  const V n = t - shifter;
  const VI ni = reinterpret_cast<VI>(t) - reinterpret_cast<VI>(shifter);
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const V z = r * r;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r + 1.0f;
  return p * reinterpret_cast<V>((ni + 127) << 23);
}

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
template <typename T, int HD, int W>
TM_INLINE void attend_run_items(const Args& a, int64_t row0, int64_t R, int64_t kvh, int64_t part, int64_t parts,
                                float* __restrict partial, float* __restrict scratch) {
  using V = Vec<W>;
  constexpr int NC = HD / W;
  constexpr int JB = 4;  // query vectors per pass of the weighted V sum
  const int64_t G = a.group;
  const int64_t J = R * G;
  const int64_t JV = (J + W - 1) / W;  // vectors of query lanes
  const int64_t JP = JV * W;  // padded lane count: the row length of st and qt
  const int64_t len0 = a.lens[row0];
  const int64_t lmax = len0 + R - 1;
  const int64_t page_size = a.page_size;
  const int64_t slot_stride = a.slot_stride;
  const float scale = a.scale;
  const T* kbase = static_cast<const T*>(a.k) + kvh * a.head_stride;
  const T* vbase = static_cast<const T*>(a.v) + kvh * a.head_stride;
  const int64_t* pages = a.table + (row0 + R - 1) * a.max_pages;
  const int64_t total_pages = (lmax + page_size - 1) / page_size;
  // This item's share of the pages: all of them, or part `part` of `parts` (see run_parts).
  const int64_t page0 = total_pages * part / parts;
  const int64_t num_pages = total_pages * (part + 1) / parts - page0;
  pages += page0;
  const int64_t base = page0 * page_size;  // the first position this item covers
  const int64_t end = std::min(lmax, base + num_pages * page_size);
  const int64_t page_elems = page_size * slot_stride;
  const int64_t page_bytes = ((page_size - 1) * slot_stride + HD) * static_cast<int64_t>(sizeof(T));

  float* __restrict st = scratch;  // [end - base][JP], row t - base for position t
  float* __restrict qt = st + lmax * JP;  // [HD][JP]
  float* __restrict accb = qt + HD * JP;  // [JP][HD]
  float* __restrict stat = accb + JP * HD;  // [2][JP]: max, then 1 / sum
  float* __restrict kbuf = stat + 2 * JP;  // [page_size][HD]

  for (int64_t j = 0; j < JP; ++j) {
    const float* q = a.q + ((row0 + j / G) * a.num_heads + kvh * G + j % G) * HD;
    for (int d = 0; d < HD; ++d) qt[d * JP + j] = j < J ? q[d] : 0.0f;
  }

  auto widen = [&](const T* src, int64_t n) {
    for (int64_t t = 0; t < n; ++t)
      for (int c = 0; c < NC; ++c) storev<W>(kbuf + t * HD + W * c, loadv<W>(src + t * slot_stride + W * c));
  };

  for (int64_t p = 0; p < std::min(kPrefetchPages, num_pages); ++p) prefetch_page(kbase + pages[p] * page_elems, page_bytes);
  for (int64_t p = 0; p < num_pages; ++p) {
    if (p + kPrefetchPages < num_pages) prefetch_page(kbase + pages[p + kPrefetchPages] * page_elems, page_bytes);
    const int64_t first = p * page_size;  // relative to base
    const int64_t n = std::min(page_size, end - base - first);
    widen(kbase + pages[p] * page_elems, n);
    for (int64_t jv = 0; jv < JV; ++jv) {
      const float* __restrict qv = qt + jv * W;
      float* __restrict sv = st + first * JP + jv * W;
      int64_t t = 0;
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

  // Softmax down each lane j over positions 0..len0 + j / G - 1 (of those this item covers), W lanes
  // at a time; only the last R - 1 positions, which some rows do not reach, lane by lane. A lane with
  // none of its positions here keeps max -inf and sum 0.
  float* __restrict sum = stat + JP;
  const int64_t full_end = std::min(end, len0);  // positions [base, full_end) are in every row
  for (int64_t jv = 0; jv < JV; ++jv) {
    V m = V{} - INFINITY;
    for (int64_t t = base; t < full_end; ++t) {
      const V x = loadv<W>(st + (t - base) * JP + jv * W);
      m = x > m ? x : m;
    }
    storev<W>(stat + jv * W, m);
  }
  for (int64_t t = std::max(base, len0); t < end; ++t) {
    const float* __restrict s = st + (t - base) * JP;
    for (int64_t j = std::min((t - len0 + 1) * G, JP); j < JP; ++j) stat[j] = s[j] > stat[j] ? s[j] : stat[j];
  }
  for (int64_t jv = 0; jv < JV; ++jv) {
    const V m = loadv<W>(stat + jv * W);
    V total = V{};
    for (int64_t t = base; t < full_end; ++t) {
      float* x = st + (t - base) * JP + jv * W;
      const V e = exp_nonpos_v<W>(loadv<W>(x) - m);
      storev<W>(x, e);
      total += e;
    }
    storev<W>(sum + jv * W, total);
  }
  for (int64_t t = std::max(base, len0); t < end; ++t) {
    float* __restrict s = st + (t - base) * JP;
    const int64_t lo = std::min((t - len0 + 1) * G, JP);  // lanes below lo end before t: weight 0
    for (int64_t j = 0; j < lo; ++j) s[j] = 0.0f;
    for (int64_t j = lo; j < JP; ++j) {
      s[j] = exp_nonpos(s[j] - stat[j]);
      sum[j] += s[j];
    }
  }

  std::fill(accb, accb + JP * HD, 0.0f);
  for (int64_t p = 0; p < std::min(kPrefetchPages, num_pages); ++p) prefetch_page(vbase + pages[p] * page_elems, page_bytes);
  for (int64_t p = 0; p < num_pages; ++p) {
    if (p + kPrefetchPages < num_pages) prefetch_page(vbase + pages[p + kPrefetchPages] * page_elems, page_bytes);
    const int64_t first = p * page_size;
    const int64_t n = std::min(page_size, end - base - first);
    widen(vbase + pages[p] * page_elems, n);
    for (int64_t j0 = 0; j0 < J; j0 += JB) {
      V acc[JB][NC];
      for (int jj = 0; jj < JB; ++jj)
        for (int c = 0; c < NC; ++c) acc[jj][c] = loadv<W>(accb + (j0 + jj) * HD + W * c);
      for (int64_t t = 0; t < n; ++t) {
        const float* __restrict s = st + (first + t) * JP + j0;
        V v[NC];
        for (int c = 0; c < NC; ++c) v[c] = loadv<W>(kbuf + t * HD + W * c);
        for (int jj = 0; jj < JB; ++jj) {
          const float w = s[jj];
          for (int c = 0; c < NC; ++c) acc[jj][c] += w * v[c];
        }
      }
      for (int jj = 0; jj < JB; ++jj)
        for (int c = 0; c < NC; ++c) storev<W>(accb + (j0 + jj) * HD + W * c, acc[jj][c]);
    }
  }
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
  return jp * (len_last + 2 + 2 * hd) + page_size * hd;
}

// W: vector width in floats of the variant (16 for AVX-512, else 8).
template <typename T, int W>
TM_INLINE void attend_row(const Args& a, int64_t seq, int64_t kvh, float* scores, float* acc) {
  switch (a.hd) {
    case 64:
      if (!attend_grouped<T, 64, W>(a, seq, kvh, scores)) attend_one_vec<T, 64, W>(a, seq, kvh, scores);
      break;
    case 128:
      if (!attend_grouped<T, 128, W>(a, seq, kvh, scores)) attend_one_vec<T, 128, W>(a, seq, kvh, scores);
      break;
    case 32:
      attend_one_vec<T, 32, W>(a, seq, kvh, scores);
      break;
    case 16:
      attend_one_vec<T, 16, W>(a, seq, kvh, scores);
      break;
      default:
      attend_one_scalar<T>(a, seq, kvh, scores, acc);  // any other head_dim: plain loops
  }
}


template <typename T, int W>
TM_INLINE void attend_range(const Args& a, int64_t begin, int64_t end, float* scores, float* acc) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t* item = a.items + i * kItemFields;
    const int64_t seq = item[0], rows = item[1], kvh = item[2], part = item[3], parts = item[4];
    if (rows == 1) {
      attend_row<T, W>(a, seq, kvh, scores, acc);
      continue;
    }
    float* partial = parts > 1 ? a.partial + item[5] : nullptr;
    if (a.hd == 64) attend_run_items<T, 64, W>(a, seq, rows, kvh, part, parts, partial, scores);
    else attend_run_items<T, 128, W>(a, seq, rows, kvh, part, parts, partial, scores);
  }
}

using RangeFn = void (*)(const Args&, int64_t, int64_t, float*, float*);

#define TM_DEFINE_VARIANT(NAME, W, ATTR)                                                     \
  ATTR void NAME##_f32(const Args& a, int64_t b, int64_t e, float* s, float* acc) {          \
    attend_range<float, W>(a, b, e, s, acc);                                                 \
  }                                                                                          \
  ATTR void NAME##_bf16(const Args& a, int64_t b, int64_t e, float* s, float* acc) {         \
    attend_range<uint16_t, W>(a, b, e, s, acc);                                              \
  }

TM_DEFINE_VARIANT(generic, 8, )
#if defined(__GNUC__) && defined(__x86_64__)
#define TM_HAVE_X86_VARIANTS 1
TM_DEFINE_VARIANT(avx2, 8, __attribute__((target("arch=x86-64-v3"))))
TM_DEFINE_VARIANT(avx512, 16, __attribute__((target("arch=x86-64-v4,prefer-vector-width=512"))))
#endif

enum Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

Isa detect_isa() {
#ifdef TM_HAVE_X86_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return kAvx512;
  if (__builtin_cpu_supports("x86-64-v3")) return kAvx2;
#endif
  return kGeneric;
}

Isa selected_isa(int64_t requested) {
  static const Isa best = detect_isa();
  // requested < 0: the best the CPU has; otherwise at most `requested` (tests cover every variant).
  return requested < 0 ? best : static_cast<Isa>(std::min<int64_t>(requested, best));
}

RangeFn pick(Isa isa, bool bf16) {
#ifdef TM_HAVE_X86_VARIANTS
  if (isa == kAvx512) return bf16 ? avx512_bf16 : avx512_f32;
  if (isa == kAvx2) return bf16 ? avx2_bf16 : avx2_f32;
#endif
  return bf16 ? generic_bf16 : generic_f32;
}


// The work of one decode-attention call: items (kItemFields each, see Args) and the scratch sizes.
// It depends only on the block table and lengths, so a fused decode step plans once for all layers.
struct Plan {
  std::vector<int64_t> items;
  int64_t scores_size = 1;   // floats of per-thread scratch
  int64_t partial_size = 0;  // floats of partial results of split runs
  int64_t num_items() const { return static_cast<int64_t>(items.size()) / kItemFields; }
};

// Validates every page id that will be read (a bad table is an error, not a wild read) and plans
// the items. Rows that continue the previous row's sequence by one token (length + 1, the same
// pages) join its run (speculative decoding's draft tokens), for the head dims the run path covers.
inline Plan make_plan(const int64_t* table_ptr, const int64_t* lens_ptr, int64_t nd, int64_t max_pages,
                      int64_t page_size, int64_t pool_pages, int64_t num_heads, int64_t kv_heads, int64_t hd,
                      Isa chosen, int64_t threads) {
  Plan plan;
  const int64_t group = num_heads / kv_heads;
  const bool runs_ok = hd == 64 || hd == 128;
  std::vector<int64_t> units;
  units.reserve(static_cast<size_t>(2 * nd));
  int64_t& scores_size = plan.scores_size;
  for (int64_t s = 0; s < nd; ++s) {
    const int64_t len = lens_ptr[s];
    TORCH_CHECK(len >= 0 && len <= max_pages * page_size, "seq_lens[", s, "] = ", len,
                " does not fit the block table's ", max_pages, " pages");
    const int64_t used = (len + page_size - 1) / page_size;
    for (int64_t p = 0; p < used; ++p) {
      const int64_t page = table_ptr[s * max_pages + p];
      TORCH_CHECK(page >= 0 && page < pool_pages, "block_table[", s, ", ", p, "] = ", page,
                  " is outside the pool of ", pool_pages, " pages");
    }
    if (runs_ok && s > 0 && units.back() < kMaxRunRows && lens_ptr[s - 1] > 0 && len == lens_ptr[s - 1] + 1) {
      const int64_t prev_used = (lens_ptr[s - 1] + page_size - 1) / page_size;
      if (std::memcmp(table_ptr + (s - 1) * max_pages, table_ptr + s * max_pages,
                      static_cast<size_t>(prev_used) * sizeof(int64_t)) == 0) {
        const int64_t rows = ++units.back();
        scores_size = std::max(scores_size, run_scratch(rows, group, len, hd, page_size));
        continue;
      }
    }
    units.push_back(s);
    units.push_back(1);
    scores_size = std::max(scores_size, group * (len + 1));
  }
  const int64_t num_units = static_cast<int64_t>(units.size()) / 2;

  // Items: (row, KV head) as before; a run wide enough to fill the vector lanes (its rows x group
  // query vectors over half a vector) is one item per KV head, or, when there are too few items to
  // keep the threads busy (one run of 3 KV heads on 2 threads), per KV head and part of its pages,
  // the parts merged below.
  const int64_t lanes = chosen == kAvx512 ? 16 : 8;
  int64_t base_items = 0;
  for (int64_t u = 0; u < num_units; ++u) {
    const int64_t rows = units[2 * u + 1];
    base_items += rows > 1 && 2 * rows * group > lanes ? kv_heads : rows * kv_heads;
  }
  std::vector<int64_t>& items = plan.items;
  items.reserve(static_cast<size_t>(kItemFields * base_items * 2));
  int64_t& partial_size = plan.partial_size;
  for (int64_t u = 0; u < num_units; ++u) {
    const int64_t row0 = units[2 * u], rows = units[2 * u + 1];
    if (rows == 1 || 2 * rows * group <= lanes) {
      for (int64_t r = row0; r < row0 + rows; ++r)
        for (int64_t h = 0; h < kv_heads; ++h) items.insert(items.end(), {r, 1, h, 0, 1, -1});
      continue;
    }
    const int64_t pages_used = (lens_ptr[row0 + rows - 1] + page_size - 1) / page_size;
    int64_t parts = 1;
    if (base_items < 2 * threads) parts = std::min<int64_t>({(2 * threads + base_items - 1) / base_items, pages_used / 4, 8});
    parts = std::max<int64_t>(parts, 1);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t part = 0; part < parts; ++part) {
        items.insert(items.end(), {row0, rows, h, part, parts, parts > 1 ? partial_size : -1});
        if (parts > 1) partial_size += rows * group * (hd + 2);
      }
  }
  return plan;
}

// Merges split runs into `out`: sum_parts acc * exp(max - M) / sum_parts sum * exp(max - M).
inline void merge_parts(const Plan& plan, const float* partial, float* out_ptr, int64_t num_heads, int64_t group,
                        int64_t hd) {
  for (int64_t i = 0; i < plan.num_items(); ++i) {
    const int64_t* item = plan.items.data() + i * kItemFields;
    if (item[4] == 1 || item[3] != 0) continue;
    const int64_t row0 = item[0], rows = item[1], kvh = item[2], parts = item[4];
    const int64_t stride = rows * group * (hd + 2);  // between the parts of one KV head
    for (int64_t j = 0; j < rows * group; ++j) {
      const float* first = partial + item[5] + j * (hd + 2);
      float m = -INFINITY;
      for (int64_t pt = 0; pt < parts; ++pt) m = std::max(m, first[pt * stride + hd]);
      float weights[8];
      float total = 0.0f;
      for (int64_t pt = 0; pt < parts; ++pt) {
        const float mp = first[pt * stride + hd];
        weights[pt] = mp == -INFINITY ? 0.0f : std::exp(mp - m);
        total += weights[pt] * first[pt * stride + hd + 1];
      }
      float* o = out_ptr + ((row0 + j / group) * num_heads + kvh * group + j % group) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        float x = 0.0f;
        for (int64_t pt = 0; pt < parts; ++pt) x += weights[pt] * first[pt * stride + d];
        o[d] = x / total;
      }
    }
  }
}

}  // namespace
}  // namespace tm_attention
