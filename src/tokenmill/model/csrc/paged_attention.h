#pragma once
// Paged decode attention: the per-ISA entry points over work items, and the planning of the items
// (the kernels: paged_attention_rows.h, paged_attention_runs.h; layout and helpers:
// paged_attention_common.h).

#include "cpu_isa_cap.h"
#include "paged_attention_rows.h"
#include "paged_attention_runs.h"

namespace tm_attention {
namespace {

// W: vector width in floats of the variant (16 for AVX-512, else 8); R: the cache reader.
// A row split into parts (make_plan) has a head_dim of the vector path.
template <typename R, int W>
TM_INLINE void attend_row(const Args& a, int64_t seq, int64_t kvh, float* scores, float* acc, int64_t part,
                          int64_t parts, float* partial) {
  switch (a.hd) {  // acc: the rotated queries' room there (group * head_dim floats)
    case 64: attend_one_vec<R, 64, W>(a, seq, kvh, scores, acc, part, parts, partial); break;
    case 128: attend_one_vec<R, 128, W>(a, seq, kvh, scores, acc, part, parts, partial); break;
    case 256: attend_one_vec<R, 256, W>(a, seq, kvh, scores, acc, part, parts, partial); break;
    case 32: attend_one_vec<R, 32, W>(a, seq, kvh, scores, acc, part, parts, partial); break;
    case 16: attend_one_vec<R, 16, W>(a, seq, kvh, scores, acc, part, parts, partial); break;
    default: attend_one_scalar<R>(a, seq, kvh, scores, acc);  // any other head_dim: plain loops
  }
}

template <typename R, int W, bool Pairs>
TM_INLINE void attend_range(const Args& a, int64_t begin, int64_t end, float* scores, float* acc) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t* item = a.items + i * kItemFields;
    const int64_t seq = item[0], rows = item[1], kvh = item[2], part = item[3], parts = item[4];
    float* partial = parts > 1 ? a.partial + item[5] : nullptr;
    if (rows == 1) {
      attend_row<R, W>(a, seq, kvh, scores, acc, part, parts, partial);
      continue;
    }
    if (a.hd == 64) attend_run_items<R, 64, W, Pairs>(a, seq, rows, kvh, part, parts, partial, scores);
    else if (a.hd == 128) attend_run_items<R, 128, W, Pairs>(a, seq, rows, kvh, part, parts, partial, scores);
    else attend_run_items<R, 256, W, Pairs>(a, seq, rows, kvh, part, parts, partial, scores);
  }
}

using RangeFn = void (*)(const Args&, int64_t, int64_t, float*, float*);

// One entry per ISA variant: a table of attend_range per cache format (tm_kv::CacheFormat order).
// PAIRS: runs over bf16 / int8 caches multiply bf16 pairs (paged_attention_pairs.h).
#define TM_DEFINE_VARIANT(NAME, W, PAIRS, ATTR)                                                       \
  template <typename R>                                                                               \
  ATTR void NAME##_range(const Args& a, int64_t b, int64_t e, float* s, float* acc) {                 \
    attend_range<R, W, PAIRS>(a, b, e, s, acc);                                                       \
  }                                                                                                   \
  constexpr RangeFn NAME##_fns[] = {NAME##_range<F32Rows>, NAME##_range<Bf16Rows>, NAME##_range<Int8Rows>};

TM_DEFINE_VARIANT(generic, 8, false, )
#if defined(__GNUC__) && defined(__x86_64__)
#define TM_HAVE_X86_VARIANTS 1
TM_DEFINE_VARIANT(avx2, 8, false, __attribute__((target("arch=x86-64-v3"))))
TM_DEFINE_VARIANT(avx512, 16, false, __attribute__((target("arch=x86-64-v4,prefer-vector-width=512"))))
TM_DEFINE_VARIANT(avx512bf16, 16, true, TM_PAIRS_TARGET)
#endif

enum Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

Isa detect_isa() {
#ifdef TM_HAVE_X86_VARIANTS
  __builtin_cpu_init();
  const bool avx512 = tm_isa::allows(tm_isa::kCapAvx512) && __builtin_cpu_supports("x86-64-v4");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return kAvx512Bf16;
  if (avx512) return kAvx512;
  if (tm_isa::allows(tm_isa::kCapAvx2) && __builtin_cpu_supports("x86-64-v3")) return kAvx2;
#endif
  return kGeneric;
}

Isa selected_isa(int64_t requested) {
  static const Isa best = detect_isa();
  // requested < 0: the best the CPU has; otherwise at most `requested` (tests cover every variant).
  return requested < 0 ? best : static_cast<Isa>(std::min<int64_t>(requested, best));
}

#ifdef TM_HAVE_X86_VARIANTS
// The AVX-512 entries only: the fused decode steps (which need AVX-512) take theirs from here, so the
// other variants are never compiled into their library, and a speculative run there gets the
// products the op gives it (bf16 pairs where the CPU has AVX512-BF16).
inline RangeFn pick_avx512(Isa isa, CacheFormat format) {
  return isa == kAvx512Bf16 ? avx512bf16_fns[format] : avx512_fns[format];
}
#endif

RangeFn pick(Isa isa, CacheFormat format) {
#ifdef TM_HAVE_X86_VARIANTS
  if (isa >= kAvx512) return pick_avx512(isa, format);
  if (isa == kAvx2) return avx2_fns[format];
#endif
  return generic_fns[format];
}

// The work of one decode-attention call: items (kItemFields each, see Args) and the scratch sizes.
// It depends only on the block table and lengths, so a fused decode step plans once for all layers.
struct Plan {
  std::vector<int64_t> items;
  int64_t scores_size = 1;   // floats of per-thread scratch
  int64_t partial_size = 0;  // floats of partial results of split runs
  int64_t num_items() const { return static_cast<int64_t>(items.size()) / kItemFields; }
};

// Work of one item, in query vectors x positions (what its loops multiply-add): a run covers its
// first row's window start to its last row's length for all its rows' query vectors, split in parts.
inline int64_t item_cost(const int64_t* item, const int64_t* lens, int64_t group, int64_t window) {
  const int64_t row0 = item[0], rows = item[1], parts = item[4];
  const int64_t positions = lens[row0 + rows - 1] - first_visible(lens[row0], window);
  return (positions / parts + 1) * rows * group;
}

// Reorders the items so that the contiguous chunks of ceil(n / team) items that at::parallel_for
// (and the fused steps' teams) hand each thread carry about equal work. In plan order a prompt's
// runs grow with their position, so the last chunk held most of it: 3/4 of a 512-token prompt's
// attention on 2 threads. Largest first, each to the least-loaded thread with room left in its
// chunk. Items write disjoint outputs (and partial slots fixed in the item), so order changes no
// result.
inline void balance_items(std::vector<int64_t>& items, const int64_t* lens, int64_t group, int64_t window,
                          int64_t threads) {
  const int64_t n = static_cast<int64_t>(items.size()) / kItemFields;
  const int64_t team = std::min(threads, n);
  if (team < 2) return;
  const int64_t chunk = (n + team - 1) / team;
  std::vector<int64_t> order(static_cast<size_t>(n)), cost(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    order[i] = i;
    cost[i] = item_cost(items.data() + i * kItemFields, lens, group, window);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
  std::vector<int64_t> load(static_cast<size_t>(team), 0), room(static_cast<size_t>(team));
  std::vector<std::vector<int64_t>> mine(static_cast<size_t>(team));
  for (int64_t t = 0; t < team; ++t) room[t] = std::clamp<int64_t>(n - t * chunk, 0, chunk);
  for (const int64_t i : order) {
    int64_t best = -1;
    for (int64_t t = 0; t < team; ++t)
      if (room[t] > 0 && (best < 0 || load[t] < load[best])) best = t;
    mine[best].push_back(i);
    load[best] += cost[i];
    --room[best];
  }
  std::vector<int64_t> out;
  out.reserve(items.size());
  for (const auto& list : mine)
    for (const int64_t i : list) out.insert(out.end(), items.begin() + i * kItemFields, items.begin() + (i + 1) * kItemFields);
  items.swap(out);
}

// How many parts a row or run of `pages` visible pages is cut into (each of at least `min_pages`, up to
// 8) so that `base_items` items make 2 a thread; 1 where they already do.
inline int64_t parts_for(int64_t base_items, int64_t threads, int64_t pages, int64_t min_pages) {
  if (base_items >= 2 * threads) return 1;
  return std::clamp<int64_t>(std::min((2 * threads + base_items - 1) / base_items, pages / min_pages), 1, 8);
}

// Validates every page id that will be read (a bad table is an error, not a wild read) and plans
// the items. Rows that continue the previous row's sequence by one token (length + 1, the same
// pages) join its run (speculative decoding's draft tokens), for the head dims the run path covers.
// Under a sliding window (window > 0) the entries of pages wholly before a row's window are neither
// checked nor read: a hybrid KV cache frees those pages.
inline Plan make_plan(const int64_t* table_ptr, const int64_t* lens_ptr, int64_t nd, int64_t max_pages,
                      int64_t page_size, int64_t pool_pages, int64_t num_heads, int64_t kv_heads, int64_t hd,
                      Isa chosen, int64_t threads, int64_t window = 0) {
  Plan plan;
  const int64_t group = num_heads / kv_heads;
  const bool runs_ok = hd == 64 || hd == 128 || hd == 256;  // attend_range's run skeletons
  std::vector<int64_t> units;
  units.reserve(static_cast<size_t>(2 * nd));
  int64_t& scores_size = plan.scores_size;
  for (int64_t s = 0; s < nd; ++s) {
    const int64_t len = lens_ptr[s];
    TORCH_CHECK(len >= 0 && len <= max_pages * page_size, "seq_lens[", s, "] = ", len,
                " does not fit the block table's ", max_pages, " pages");
    const int64_t used = (len + page_size - 1) / page_size;
    for (int64_t p = first_visible(len, window) / page_size; p < used; ++p) {
      const int64_t page = table_ptr[s * max_pages + p];
      TORCH_CHECK(page >= 0 && page < pool_pages, "block_table[", s, ", ", p, "] = ", page,
                  " is outside the pool of ", pool_pages, " pages");
    }
    if (runs_ok && s > 0 && units.back() < kMaxRunRows && lens_ptr[s - 1] > 0 && len == lens_ptr[s - 1] + 1) {
      const int64_t prev_used = (lens_ptr[s - 1] + page_size - 1) / page_size;
      // From the run's first row's window on: the kernel reads the last row's entries from there.
      const int64_t p0 = first_visible(lens_ptr[units[units.size() - 2]], window) / page_size;
      if (std::memcmp(table_ptr + (s - 1) * max_pages + p0, table_ptr + s * max_pages + p0,
                      static_cast<size_t>(prev_used - p0) * sizeof(int64_t)) == 0) {
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
  const int64_t lanes = chosen >= kAvx512 ? 16 : 8;
  int64_t base_items = 0;
  for (int64_t u = 0; u < num_units; ++u) {
    const int64_t rows = units[2 * u + 1];
    base_items += rows > 1 && 2 * rows * group > lanes ? kv_heads : rows * kv_heads;
  }
  std::vector<int64_t>& items = plan.items;
  items.reserve(static_cast<size_t>(kItemFields * base_items * 2));
  int64_t& partial_size = plan.partial_size;
  // Single rows likewise, when they are long enough for each part to cover kMinRowPartPages (batch-1
  // decode at long contexts: SmolLM2's 3 KV heads on 2 threads split 2 : 1 otherwise). Not one KV head
  // of head_dim > 128 (Gemma 3): the fused row step splits its query heads between the threads instead
  // (decode_row_phases.h), which measured 3-7 % faster than parts at 1,000-4,000 positions.
  const bool rows_may_split = (hd == 16 || hd == 32 || hd == 64 || hd == 128 || hd == 256) && !(kv_heads == 1 && hd > 128);
  for (int64_t u = 0; u < num_units; ++u) {
    const int64_t row0 = units[2 * u], rows = units[2 * u + 1];
    if (rows == 1 || 2 * rows * group <= lanes) {
      for (int64_t r = row0; r < row0 + rows; ++r) {
        const int64_t pages_seen = (lens_ptr[r] + page_size - 1) / page_size - first_visible(lens_ptr[r], window) / page_size;
        const int64_t parts = rows_may_split ? parts_for(base_items, threads, pages_seen, kMinRowPartPages) : 1;
        for (int64_t h = 0; h < kv_heads; ++h)
          for (int64_t part = 0; part < parts; ++part) {
            items.insert(items.end(), {r, 1, h, part, parts, parts > 1 ? partial_size : -1});
            if (parts > 1) partial_size += group * (hd + 2);
          }
      }
      continue;
    }
    const int64_t pages_used = (lens_ptr[row0 + rows - 1] + page_size - 1) / page_size -
                               first_visible(lens_ptr[row0], window) / page_size;
    const int64_t parts = parts_for(base_items, threads, pages_used, 4);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t part = 0; part < parts; ++part) {
        items.insert(items.end(), {row0, rows, h, part, parts, parts > 1 ? partial_size : -1});
        if (parts > 1) partial_size += rows * group * (hd + 2);
      }
  }
  // Steps of single decode rows keep the plan order (similar rows; no sort on the hot path).
  if (num_units < nd)
    balance_items(items, lens_ptr, group, window, threads);
  return plan;
}

// The Args of one call over `plan` (the callers set k and v: one layer's caches at a time).
inline Args make_args(const Plan& plan, const float* q, float* out, float* partial, const int64_t* table,
                      const int64_t* lens, int64_t max_pages, int64_t page_size, int64_t num_heads, int64_t kv_heads,
                      int64_t hd, float scale, int64_t head_stride, int64_t slot_stride) {
  Args a{};
  a.q = q;
  a.out = out;
  a.partial = partial;
  a.items = plan.items.data();
  a.table = table;
  a.lens = lens;
  a.max_pages = max_pages;
  a.page_size = page_size;
  a.num_heads = num_heads;
  a.kv_heads = kv_heads;
  a.group = num_heads / kv_heads;
  a.hd = hd;
  a.scale = scale;
  a.head_stride = head_stride;
  a.slot_stride = slot_stride;
  return a;
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
