#pragma once
// Cascade attention for decode rows that share a prefix (many streams under a system prompt; a group
// of rows under each of up to kMaxGroups prompts), in the fused decode step and in the decode
// attention op: a group's shared pages attended once for all its rows on AMX tiles
// (prompt_flash_amx.h, every query seeing every key), each row's own positions by the paged kernel
// (paged_attention.h, from the prefix's end on), and the two parts merged by their softmax max and
// sum (flash attention's merge).
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

// At most this many groups a step: each packs its prefix's tiles every layer.
constexpr int64_t kMaxGroups = 8;

// Rows that share one prefix: `prefix` tokens (whole pages) on `pages`, shared by Plan::rows[first,
// first + count).
struct Group {
  int64_t prefix = 0;
  const int64_t* pages = nullptr;
  int64_t first = 0, count = 0;
};

// Which rows share which prefix: `rows` group by group (each group's in step order); where[t] = row
// t's index in rows, or -1; each row sees its own positions from starts[t] = its group's prefix on.
struct Plan {
  std::vector<Group> groups;
  std::vector<int64_t> rows, where, starts;
  bool on() const { return !groups.empty(); }
};

// The groups of rows and shared prefixes that save the most: among the rows' block tables (each up to
// the whole pages before its newest token, which stays its own), sorted, the run of adjacent rows
// whose common pages times their number is largest (the largest rectangle under the adjacent rows'
// common-prefix lengths); then the same among the rows left, up to kMaxGroups groups. So each system
// prompt's streams cascade over it, and a row that shares only a prompt's first pages is left to the
// kernel or joins a group over those pages. A group needs >= min_rows rows and >= min_prefix tokens
// (min_rows <= 0: never), and the attention's items must be single rows, whole (no runs of one
// sequence's rows: speculative decoding; no row split between threads), over bf16 or int8 rows of a head dim the tiles take, where this
// process may run them.
inline Plan plan(const tm_attention::Plan& items, const int64_t* table, const int64_t* lens, int64_t T, int64_t max_pages,
                 int64_t page_size, tm_kv::CacheFormat format, int64_t head_dim, int64_t min_rows, int64_t min_prefix) {
  Plan p;
  if (min_rows <= 0 || T < min_rows || format == tm_kv::kCacheF32 || !tm_flash::takes_head_dim(head_dim) ||
      !tm_amx::amx_ready())
    return p;
  for (int64_t i = 0; i < items.num_items(); ++i)
    if (items.items[i * tm_attention::kItemFields + 1] != 1 || items.items[i * tm_attention::kItemFields + 4] != 1) return p;
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
  const int64_t need = std::max<int64_t>(min_prefix, 1);
  std::vector<int64_t> lcp;
  while (static_cast<int64_t>(p.groups.size()) < kMaxGroups) {
    const int64_t n = static_cast<int64_t>(order.size());
    lcp.assign(n > 0 ? n - 1 : 0, 0);  // the rows taken are gone: neighbours across them compared anew
    for (int64_t i = 0; i + 1 < n; ++i) lcp[i] = common(order[i], order[i + 1]);
    int64_t best = 0, first = 0, count = 0, shared = 0;
    for (int64_t i = 0; i < n; ++i) {
      int64_t low = max_pages;
      for (int64_t j = i + 1; j < n && lcp[j - 1] > 0; ++j) {
        low = std::min(low, lcp[j - 1]);
        const int64_t rows = j - i + 1;
        if (rows >= min_rows && low * page_size >= need && rows * low > best)
          best = rows * low, first = i, count = rows, shared = low;
      }
    }
    if (best == 0) break;
    const Group g{shared * page_size, table + order[first] * max_pages, static_cast<int64_t>(p.rows.size()), count};
    std::vector<int64_t> mine(order.begin() + first, order.begin() + first + count);
    std::sort(mine.begin(), mine.end());  // step order
    if (p.groups.empty()) p.where.assign(T, -1), p.starts.assign(T, 0);
    for (int64_t c = 0; c < count; ++c) {
      p.where[mine[c]] = g.first + c, p.starts[mine[c]] = g.prefix;
      p.rows.push_back(mine[c]);
    }
    p.groups.push_back(g);
    order.erase(order.begin() + first, order.begin() + first + count);
  }
  return p;
}

#if TM_AMX_COMPILES

// One group's buffers: its prefix's key tiles and packed values for one layer, and a counter of its
// tile items per layer.
struct GroupWork {
  int64_t Tp = 0;
  std::vector<uint16_t> keys, values;
  std::vector<const uint16_t*> key_tiles;  // [KVH][Tp / 16] (tm_flash::key_tiles)
  std::unique_ptr<std::atomic<int64_t>[]> next;
};

// A stack's buffers for its cascade steps, kept between steps (sized by prepare): the rows' queries
// as bf16, the prefix outputs and stats (rows in Plan::rows order), the rows' own stats, each group's
// buffers, and each thread's tile scratch.
struct Work {
  std::vector<uint16_t> q;          // [C, H, D]
  std::vector<float> out;           // [C, H, D]
  std::vector<float> prefix_stats;  // [C, H, 2]: max, sum
  std::vector<float> own_stats;     // [T, H, 2]
  std::vector<GroupWork> groups;
  std::vector<std::unique_ptr<tm_flash::Scratch>> scratch;
  int64_t D32 = 0, layers = 0;
  bool rotated = false;  // int8 rows in H's basis: the queries go in rotated, the prefix's outputs come back

  void prepare(const Plan& p, int64_t T, int64_t H, int64_t KVH, int64_t D, tm_kv::CacheFormat format,
               int64_t page_size, int64_t num_layers, int threads) {
    const int64_t C = static_cast<int64_t>(p.rows.size());
    D32 = tm_flash::round_up(D, 32);
    rotated = format == tm_kv::kCacheInt8 && tm_kv::rotates(D);
    q.resize(C * H * D), out.resize(C * H * D), prefix_stats.resize(C * H * 2), own_stats.resize(T * H * 2);
    if (layers != num_layers) groups.clear(), layers = num_layers;
    if (groups.size() < p.groups.size()) groups.resize(p.groups.size());
    for (size_t g = 0; g < p.groups.size(); ++g) {
      GroupWork& gw = groups[g];
      gw.Tp = tm_flash::round_up(p.groups[g].prefix, 64);
      // keys read where they lie need no packed copy (up to 8 groups, each the prefix's size)
      gw.keys.resize(tm_flash::keys_in_place(format == tm_kv::kCacheInt8, page_size, D) ? 0 : KVH * gw.Tp * D32);
      gw.values.resize(KVH * gw.Tp * D), gw.key_tiles.resize(KVH * gw.Tp / 16);
      if (!gw.next) gw.next.reset(new std::atomic<int64_t>[layers]);
      for (int64_t i = 0; i < layers; ++i) gw.next[i] = 0;
    }
    if (!scratch.empty() && scratch[0]->acc.size() != static_cast<size_t>(tm_flash::kHeads * D * 16)) scratch.clear();
    while (static_cast<int>(scratch.size()) < threads) scratch.push_back(tm_flash::make_scratch(D, D32));
  }
};

// The tile calls over one layer's caches (a.k, a.v, laid out as `a` says, rows of `format`), one a
// group, into pr[0 .. groups): the group's queries against its prefix's rows as stored (rotation
// handled by the caller, see Work::rotated), every key seen, softmax stats out.
inline void problems(const Plan& p, Work& w, const tm_attention::Args& a, tm_kv::CacheFormat format, tm_flash::Problem* pr) {
  const int64_t elem = format == tm_kv::kCacheInt8 ? 1 : 2, H = a.num_heads, D = a.hd;
  const bool int8 = format == tm_kv::kCacheInt8;
  for (size_t i = 0; i < p.groups.size(); ++i) {
    const Group& g = p.groups[i];
    tm_flash::PagedRows k{static_cast<const uint8_t*>(a.k), a.head_stride * elem, a.slot_stride * elem, g.pages,
                          a.page_size, int8, false};
    tm_flash::PagedRows v = k;
    v.base = static_cast<const uint8_t*>(a.v);
    pr[i] = tm_flash::Problem{w.q.data() + g.first * H * D, H * D, D, k, v, w.out.data() + g.first * H * D, false,
                              g.count, g.prefix, H, a.kv_heads, D, a.scale};
    pr[i].causal = false;
    pr[i].stats = w.prefix_stats.data() + g.first * H * 2;
  }
}

// Packing unit u of a layer (groups x KV heads x {keys, values}).
inline int64_t pack_units(const Plan& p, int64_t KVH) { return static_cast<int64_t>(p.groups.size()) * 2 * KVH; }

inline void pack_unit(Work& w, const tm_flash::Problem* pr, int64_t KVH, int64_t u) {
  const int64_t i = u / (2 * KVH), h = u % (2 * KVH) / 2;
  GroupWork& gw = w.groups[i];
  if (u % 2 == 0)
    tm_flash::key_tiles(pr[i], h, gw.Tp, w.D32, gw.keys.empty() ? nullptr : gw.keys.data() + h * gw.Tp * w.D32,
                        gw.key_tiles.data() + h * gw.Tp / 16);
  else
    tm_flash::pack_values(pr[i], h, gw.Tp, gw.values.data() + h * gw.Tp * pr[i].D);
}

// The calling thread's share of every group's tile items of `layer` (taken from each group's counter
// until none is left).
inline void run_groups(const Plan& p, Work& w, const tm_flash::Problem* pr, int64_t layer, tm_flash::Scratch& s) {
  for (size_t i = 0; i < p.groups.size(); ++i) {
    GroupWork& gw = w.groups[i];
    tm_flash::run_items(pr[i], gw.next[layer], gw.key_tiles.data(), tm_flash::key_layout(pr[i]), gw.values.data(), gw.Tp,
                        w.D32, s);
  }
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
// rows), around the op's own pass over its items. begin: sets `args`' starts and stats, fills pr (one
// problem a group), packs the prefixes' tiles and rounds the rows' queries. finish, after the items:
// the prefixes' items on the tiles, then the merge. Each part an at::parallel_for.
inline void begin_call(const Plan& p, Work& cw, tm_attention::Args& args, tm_kv::CacheFormat format, tm_flash::Problem* pr) {
  const int64_t H = args.num_heads, KVH = args.kv_heads, D = args.hd, C = static_cast<int64_t>(p.rows.size());
  args.starts = p.starts.data();
  args.stats = cw.own_stats.data();
  problems(p, cw, args, format, pr);
  const int64_t units = pack_units(p, KVH);
  at::parallel_for(0, units + C, 1, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      if (u >= units) round_queries(p, cw, args.q, H, D, u - units, u - units + 1);
      else pack_unit(cw, pr, KVH, u);
    }
  });
}

inline void finish_call(const Plan& p, Work& cw, const tm_attention::Args& args, const tm_flash::Problem* pr) {
  at::parallel_for(0, static_cast<int64_t>(cw.scratch.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) run_groups(p, cw, pr, 0, *cw.scratch[t]);
  });
  at::parallel_for(0, static_cast<int64_t>(p.where.size()), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) merge_row(p, cw, args.out, t, args.num_heads, args.hd);
  });
}

#endif  // TM_AMX_COMPILES

}  // namespace tm_cascade
