#pragma once
// Cascade attention for decode rows that share a prefix (many streams under one system prompt), in
// the fused decode step and in the decode attention op: the shared pages attended once for all those
// rows on AMX tiles (prompt_flash_amx.h, every query seeing every key), each row's own positions by
// the paged kernel (paged_attention.h, from the prefix's end on), and the two parts merged by their
// softmax max and sum (flash attention's merge).
//
// Why: at many streams a decode row reads its whole context, and the shared prefix is read by every
// row. Those pages stay in cache, so the prefix is vector arithmetic done once a row: a 64-row step of
// the bundled model at 2,048 tokens, 1,008 of them shared, took 172 ms (bf16 K/V; int8 135) against
// 141 ms (104) for the same rows over their own 1,040 positions only (/work/scratch/s26/shared_step.py).
// On the tiles the prefix is one item per (KV head, query heads, 16 rows), its V (and int8 K) packed
// once a layer for all of them: that step took 145 ms (int8 109), ~1 ms a layer less.
//
// The prefix's scores and weights are bf16 products on the tiles, as a prompt's attention computes
// them (prompt_flash_amx.h); the rows' own positions keep the decode kernel's fp32 arithmetic.
//
// Needs paged_attention.h included first. The fused step's phase: decode_phases.h; the op's call
// (a mixed step's decode rows): begin_call and finish_call below.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

#include "prompt_flash_amx.h"

namespace tm_cascade {

// Which rows share which prefix: `prefix` tokens (whole pages, 0: no cascade) on `pages`, shared by
// `rows` (step order; where[t] = index in rows, or -1), each of which sees its own positions from
// starts[t] = prefix on.
struct Plan {
  int64_t prefix = 0;
  const int64_t* pages = nullptr;
  std::vector<int64_t> rows, where, starts;
  bool on() const { return prefix > 0; }
};

// The rows and shared prefix that save the most: among the rows' block tables (each up to the whole
// pages before its newest token, which stays its own), sorted, the run of adjacent rows whose common
// pages times their number is largest (the largest rectangle under the adjacent rows' common-prefix
// lengths). So a row that shares only the first pages of a system prompt, or a second group under
// another prompt, leaves the rest to cascade. A cascade when that is >= min_rows rows and >=
// min_prefix tokens (min_rows <= 0: never), and the attention's items are single rows (no runs of
// one sequence's rows: speculative decoding), over bf16 or int8 rows of a head dim the tiles take,
// where this process may run them.
inline Plan plan(const tm_attention::Plan& items, const int64_t* table, const int64_t* lens, int64_t T, int64_t max_pages,
                 int64_t page_size, tm_kv::CacheFormat format, int64_t head_dim, int64_t min_rows, int64_t min_prefix) {
  Plan p;
  if (min_rows <= 0 || T < min_rows || format == tm_kv::kCacheF32 || !tm_flash::takes_head_dim(head_dim) ||
      !tm_amx::amx_ready())
    return p;
  for (int64_t i = 0; i < items.num_items(); ++i)
    if (items.items[i * tm_attention::kItemFields + 1] != 1) return p;
  auto full = [&](int64_t t) { return std::min(max_pages, (lens[t] - 1) / page_size); };  // pages a row may share
  auto common = [&](int64_t a, int64_t b) {
    const int64_t n = std::min(full(a), full(b));
    int64_t same = 0;
    while (same < n && table[a * max_pages + same] == table[b * max_pages + same]) ++same;
    return same;
  };
  std::vector<int64_t> order;
  for (int64_t t = 0; t < T; ++t)
    if (lens[t] > 0 && full(t) > 0) order.push_back(t);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t same = common(a, b), na = full(a), nb = full(b);
    if (same < na && same < nb) return table[a * max_pages + same] < table[b * max_pages + same];
    return na < nb || (na == nb && a < b);  // one a prefix of the other: the shorter first
  });
  const int64_t n = static_cast<int64_t>(order.size());
  std::vector<int64_t> lcp(n > 0 ? n - 1 : 0);
  for (int64_t i = 0; i + 1 < n; ++i) lcp[i] = common(order[i], order[i + 1]);
  int64_t best = 0, first = 0, count = 0, shared = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t low = max_pages;
    for (int64_t j = i + 1; j < n && lcp[j - 1] > 0; ++j) {
      low = std::min(low, lcp[j - 1]);
      const int64_t rows = j - i + 1;
      if (rows >= min_rows && low * page_size >= std::max<int64_t>(min_prefix, 1) && rows * low > best)
        best = rows * low, first = i, count = rows, shared = low;
    }
  }
  if (best == 0) return p;
  p.prefix = shared * page_size;
  p.pages = table + order[first] * max_pages;
  p.where.assign(T, -1);
  p.starts.assign(T, 0);
  p.rows.assign(order.begin() + first, order.begin() + first + count);
  std::sort(p.rows.begin(), p.rows.end());  // step order
  for (int64_t c = 0; c < count; ++c) p.where[p.rows[c]] = c, p.starts[p.rows[c]] = p.prefix;
  return p;
}

#if TM_AMX_COMPILES

// A stack's buffers for its cascade steps, kept between steps (sized by prepare): the rows' queries
// as bf16, the prefix's outputs and stats, the rows' own stats, one layer's prefix key tiles and packed
// values, a counter of the tile items per layer, and each thread's tile scratch.
struct Work {
  std::vector<uint16_t> q;          // [C, H, D]
  std::vector<float> out;           // [C, H, D]
  std::vector<float> prefix_stats;  // [C, H, 2]: max, sum
  std::vector<float> own_stats;     // [T, H, 2]
  std::vector<uint16_t> keys, values;
  std::vector<const uint16_t*> key_tiles;  // [KVH][Tp / 16] (tm_flash::key_tiles)
  std::unique_ptr<std::atomic<int64_t>[]> next;
  std::vector<std::unique_ptr<tm_flash::Scratch>> scratch;
  int64_t Tp = 0, D32 = 0, layers = 0;
  bool rotated = false;  // int8 rows in H's basis: the queries go in rotated, the prefix's outputs come back

  void prepare(const Plan& p, int64_t T, int64_t H, int64_t KVH, int64_t D, tm_kv::CacheFormat format,
               int64_t num_layers, int threads) {
    const int64_t C = static_cast<int64_t>(p.rows.size());
    Tp = tm_flash::round_up(p.prefix, 64), D32 = tm_flash::round_up(D, 32);
    rotated = format == tm_kv::kCacheInt8 && tm_kv::rotates(D);
    q.resize(C * H * D), out.resize(C * H * D), prefix_stats.resize(C * H * 2), own_stats.resize(T * H * 2);
    keys.resize(KVH * Tp * D32), values.resize(KVH * Tp * D), key_tiles.resize(KVH * Tp / 16);
    if (layers != num_layers) next.reset(new std::atomic<int64_t>[num_layers]), layers = num_layers;
    for (int64_t i = 0; i < layers; ++i) next[i] = 0;
    if (!scratch.empty() && scratch[0]->acc.size() != static_cast<size_t>(tm_flash::kHeads * D * 16)) scratch.clear();
    while (static_cast<int>(scratch.size()) < threads) scratch.push_back(tm_flash::make_scratch(D, D32));
  }
};

// The tile call over one layer's caches (a.k, a.v, laid out as `a` says, rows of `format`): the
// rows' queries against the prefix's rows as stored (rotation handled by the caller, see
// Work::rotated), every key seen, softmax stats out.
inline tm_flash::Problem problem(const Plan& p, Work& w, const tm_attention::Args& a, tm_kv::CacheFormat format) {
  const int64_t elem = format == tm_kv::kCacheInt8 ? 1 : 2;
  const bool int8 = format == tm_kv::kCacheInt8;
  tm_flash::PagedRows k{static_cast<const uint8_t*>(a.k), a.head_stride * elem, a.slot_stride * elem, p.pages, a.page_size,
                        int8, false};
  tm_flash::PagedRows v = k;
  v.base = static_cast<const uint8_t*>(a.v);
  tm_flash::Problem pr{w.q.data(), a.num_heads * a.hd, a.hd, k, v, w.out.data(), false,
                       static_cast<int64_t>(p.rows.size()), p.prefix, a.num_heads, a.kv_heads, a.hd, a.scale};
  pr.causal = false;
  pr.stats = w.prefix_stats.data();
  return pr;
}

// Rows [c0, c1) of the cascade's queries (q [T, H, D] fp32) as bf16, rotated first where the rows are.
TA_TARGET inline void round_queries(const Plan& p, Work& w, const float* q, int64_t H, int64_t D, int64_t c0, int64_t c1) {
  alignas(64) float x[256];
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t h = 0; h < H; ++h) {
      const float* src = q + (p.rows[c] * H + h) * D;
      if (w.rotated) {
        std::memcpy(x, src, D * sizeof(float));
        tm_kv::rotate(x, D, true);
        src = x;
      }
      uint16_t* dst = w.q.data() + (c * H + h) * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + d)));
    }
}

// Row t's outputs (attn [T, H, D], its own part, normalised) merged with its prefix part: weights
// sum x exp(max - M) of each part.
inline void merge_row(const Plan& p, Work& w, float* attn, int64_t t, int64_t H, int64_t D) {
  const int64_t c = p.where[t];
  if (c < 0) return;
  for (int64_t h = 0; h < H; ++h) {
    float* o = attn + (t * H + h) * D;
    float* x = w.out.data() + (c * H + h) * D;
    if (w.rotated) tm_kv::rotate(x, D, true);  // back from H's basis
    const float* own = w.own_stats.data() + (t * H + h) * 2;
    const float* pre = w.prefix_stats.data() + (c * H + h) * 2;
    const float m = std::max(own[0], pre[0]);
    const float a = own[1] * std::exp(own[0] - m), b = pre[1] * std::exp(pre[0] - m);
    const float fa = a / (a + b), fb = b / (a + b);
    for (int64_t d = 0; d < D; ++d) o[d] = fa * o[d] + fb * x[d];
  }
}

// Cascade attention in the decode attention op (csrc/paged_attention.cpp: a mixed step's decode
// rows), around the op's own pass over its items. begin: sets `args`' starts and stats, packs the
// prefix's tiles and rounds the rows' queries. finish, after the items: the prefix's items on the
// tiles, then the merge. Each part an at::parallel_for.
inline tm_flash::Problem begin_call(const Plan& p, Work& cw, tm_attention::Args& args, tm_kv::CacheFormat format) {
  const int64_t H = args.num_heads, KVH = args.kv_heads, D = args.hd, C = static_cast<int64_t>(p.rows.size());
  args.starts = p.starts.data();
  args.stats = cw.own_stats.data();
  const tm_flash::Problem pr = problem(p, cw, args, format);
  at::parallel_for(0, 2 * KVH + C, 1, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      const int64_t g = u / 2;
      if (u >= 2 * KVH) round_queries(p, cw, args.q, H, D, u - 2 * KVH, u - 2 * KVH + 1);
      else if (u % 2 == 0) tm_flash::key_tiles(pr, g, cw.Tp, cw.D32, cw.keys.data() + g * cw.Tp * cw.D32, cw.key_tiles.data() + g * cw.Tp / 16);
      else tm_flash::pack_values(pr, g, cw.Tp, cw.values.data() + g * cw.Tp * D);
    }
  });
  return pr;
}

inline void finish_call(const Plan& p, Work& cw, const tm_attention::Args& args, const tm_flash::Problem& pr) {
  at::parallel_for(0, static_cast<int64_t>(cw.scratch.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      tm_flash::run_items(pr, cw.next[0], cw.key_tiles.data(), tm_flash::key_layout(pr), cw.values.data(), cw.Tp, cw.D32,
                          *cw.scratch[t]);
  });
  at::parallel_for(0, static_cast<int64_t>(p.where.size()), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) merge_row(p, cw, args.out, t, args.num_heads, args.hd);
  });
}

#endif  // TM_AMX_COMPILES

}  // namespace tm_cascade
