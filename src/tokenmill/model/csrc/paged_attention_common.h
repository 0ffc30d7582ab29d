#pragma once
// Fused paged-attention decode for CPU: one query token per sequence, K/V read straight from the
// page pool through the block table (no gather into padded tensors, no mask).
//
// Cache layout (see tokenmill/model/kv_cache_format.py): k_cache, v_cache [num_kv_heads, num_slots, row],
// head-major, slot = page * page_size + offset; a row is one token's K or V for one KV head, in one of
// the cache formats kv_cache_rows.h reads (fp32, bf16, int8 with a scale), always computed in fp32.
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

struct Args {
  const float* q;  // [nd, num_heads, hd]
  const void* k;
  const void* v;
  int64_t head_stride;  // elements between KV heads in the caches
  int64_t slot_stride;  // elements between slots (a row: head_dim values and the format's extras)
  const int64_t* table;  // [nd, max_pages]
  const int64_t* lens;  // [nd]
  int64_t max_pages;
  int64_t page_size;
  int64_t num_heads;
  int64_t kv_heads;
  int64_t group;
  int64_t hd;
  float scale;
  // Sliding window (tokens; 0: none): a row of length len sees positions first_visible(len, window)
  // .. len - 1, and the block-table entries of pages wholly before that are never read (a hybrid KV
  // cache may have freed them). softcap (0: none): scores become softcap * tanh(score / softcap)
  // (Gemma 2). Both are tested once per row or item, outside the loops.
  int64_t window;
  float softcap;
  float* out;  // [nd, num_heads, hd]
  // Work items, kItemFields each: first row, rows (> 1: a run of one sequence's consecutive rows,
  // see attend_run_items), KV head, part, parts (a run's pages may be split between items), and the
  // offset of the item's partial results in `partial` (parts > 1 only).
  const int64_t* items;
  float* partial;
  // Cascade attention (cascade_attention.h), single rows only; null otherwise: row s sees positions
  // from starts[s] on (a prefix shared with other rows is attended once for all of them on the
  // tiles), and its softmax's max and sum per query head go to stats[(s * num_heads + h) * 2 ..]
  // for the merge with the prefix's part.
  const int64_t* starts;
  float* stats;
};

// First position a row of `len` tokens sees: len - window under a sliding window, else 0.
TM_INLINE int64_t first_visible(int64_t len, int64_t window) {
  return window > 0 && len > window ? len - window : 0;
}

// Gemma 2's soft-capping, in transformers' eager order: (score / cap), tanh, * cap.
TM_INLINE void cap_scores(float* __restrict s, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) s[i] = std::tanh(s[i] / cap) * cap;
}

// Softmax numerators of the scores s[g, 0..len-1] in place (not normalised), and 1 / their sum in
// s[group * len + g]; the max and the sum in stats[2 g], stats[2 g + 1] if asked.
TM_INLINE void softmax_rows(float* __restrict scores, int64_t group, int64_t len, float* stats = nullptr) {
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
    if (stats != nullptr) stats[2 * g] = m, stats[2 * g + 1] = sum;
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
typedef int8_t v16c __attribute__((vector_size(16)));
typedef int8_t v8c __attribute__((vector_size(8)));

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
using VecI = std::conditional_t<W == 16, v16i, v8i>;

// exp_nonpos on W lanes (the same polynomial as the scalar one).
template <int W>
TM_INLINE Vec<W> exp_nonpos_v(Vec<W> x) {
  return tm_math::exp_nonpos_t<Vec<W>, VecI<W>>(x);
}

template <int W>
TM_INLINE Vec<W> loadv(const float* p) {
  Vec<W> x;
  std::memcpy(&x, p, sizeof(x));
  return x;
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
// A decode row split between threads (make_plan) has at least this many pages a part (128 positions at
// pages of 16): a split costs a merge and, in the fused row step, a barrier a layer. It measured 1.34x
// from 600 positions on (docs/benchmarks.md, session 28), and SmolLM2's batch-1 step 3 % faster at 260
// and 400 positions with parts of 8 pages against 16 (its 3 KV heads on 2 threads split 2 : 1
// otherwise); parts of 4 pages were 1.7 % faster at 300 positions and slower at 150 (session 31).
constexpr int64_t kMinRowPartPages = 8;

}  // namespace
}  // namespace tm_attention
