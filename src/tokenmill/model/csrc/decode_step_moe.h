#pragma once
// A mixture-of-experts feed-forward block inside the fused decode step (decode_step.cpp).
//
// Why in the step: at batch 1 a token reads only its k experts' bytes, which is what makes a 30B MoE
// decode like a 3B dense model; op by op (model/moe.py) the same step costs a Python loop over the
// active experts, a sort, an index_add and ~10 small ops per layer, more than the k experts' GEMVs.
//
// Arithmetic as model/moe.py's fast path computes it, from the same kernels:
// - router logits in fp32 (the router stays fp32 in every precision), softmax, top-k with ties to the
//   lower expert id (torch.topk's order on CPU), renormalised where the model says;
// - the step's (token, expert) assignments grouped by expert (a counting sort, stable in token order),
//   the rows of each active expert rounded to two int8 terms and multiplied by its column-blocked
//   gate_up and down weights (the kit's kernel), SiLU(gate) * up between;
// - each token's weighted expert outputs added in ascending expert order (moe.py's order), then the
//   shared expert (Qwen2-MoE) times sigmoid(x . gate).
//
// How the work is cut, and why (batch-1 decode is the case that matters; docs/benchmarks.md, "MoE
// batch-1 decode and memory"): a phase boundary costs a barrier, and a thread that waits past
// GOMP_SPINCOUNT sleeps and is woken late, so the block has as few phases as its data flow allows:
// - routing: a small router (T x E x hidden MACs) is computed by every thread for itself, no barrier;
//   a large one is split between the threads, then planned by one;
// - phase 1, per unit of 128 expert columns (4 activation groups): the unit's gate and up blocks,
//   SiLU(gate) * up and the rounding of those 128 activations, all in the thread that owns the unit;
//   units of every active expert (and the shared one) form one list cut evenly between the threads;
// - phase 2, per block of 16 output columns: every active expert's down blocks there, then the
//   tokens' weighted sums of exactly those columns, so no barrier separates down from the sum.
// At T = 1 the rows an expert multiplies are the step's own rounded row (a_hidden); with more rows
// each expert's rows are gathered from a_hidden's records (the same numbers: rounding is per row).
//
// The kernels are the step's kit's (decode_kits.h: AVX512-VNNI or AVX2), a template parameter.
//
// Needs decode_phases.h included first (decode_step.cpp does).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tm_moe {

struct Expert {
  tm_vnni::Weights gate_up, down;  // [2 ff, hidden] and [hidden, ff]
};

struct Block {
  std::vector<Expert> experts;
  const float* router = nullptr;  // fp32 [E, hidden]
  int64_t E = 0, k = 0, ff = 0;
  bool norm = false;
  bool has_shared = false;
  Expert shared{};
  const float* shared_gate = nullptr;  // fp32 [hidden]
  int64_t shared_ff = 0;
};

// Activation groups of 32 per phase-1 unit: 4, the span quantize4 rounds at once, so a unit's
// activations are rounded by the same calls as a whole row's (quant_acts.h `quantize_rows`).
constexpr int64_t kUnitGroups = 4;
constexpr int64_t kUnitCols = kUnitGroups * tm_vnni::kGroup;
// Routers up to this many multiply-adds a step are computed by every thread (no barrier): Mixtral's
// shape at T = 1 is 32 x 1024, ~1 us; Qwen3-30B's 128 x 2048 is split.
constexpr int64_t kPrivateRouterMACs = int64_t{1} << 16;

// A step's routing: which rows go to which expert, with what weight.
struct Route {
  std::vector<float> logits, weights;  // [T, E]; each assignment's routing weight, in grouped order
  std::vector<int64_t> token, start;   // grouped assignment -> token; expert -> first grouped row (E + 1)
  std::vector<int64_t> slot;           // token * k + j -> grouped row of its j-th expert, ascending ids
  std::vector<int64_t> ids, order, js, next;  // plan's temporaries, kept between layers
  std::vector<float> w, p;

  void resize(int64_t T, int64_t E, int64_t k) {
    logits.resize(T * E);
    weights.resize(T * k);
    token.resize(T * k);
    start.resize(E + 1);
    slot.resize(T * k);
    ids.resize(T * k);
    w.resize(T * k);
    order.resize(E);
    p.resize(E);
    next.resize(E);
    js.resize(k);
  }
};

// Per-step scratch, sized for T rows of the largest block by `reserve` (shared by the threads).
struct Scratch {
  Route route;           // the shared route of a split router
  std::vector<float> f;  // gathered rows, activations, outputs (see `ffn`)
  int64_t T = 0, E = 0, k = 0, max_ff = 0;
};

// A thread's own buffers: a private route, one unit's gate | up outputs and activations.
struct Local {
  Route route;
  std::vector<float> unit;
};

inline Local& local() {
  static thread_local Local l;
  return l;
}

inline int64_t buffer_floats(const Block& b, int64_t T, int64_t hidden, int64_t terms) {
  const int64_t R = T * b.k, sf = b.shared_ff;
  int64_t n = R * hidden + tm_vnni::acts_floats(R, hidden, terms);  // down outputs, gathered rows
  n += tm_vnni::acts_floats(R, b.ff, terms);                         // rounded activations
  if (b.has_shared) n += T * hidden + tm_vnni::acts_floats(T, sf, terms);
  return n + 64;
}

inline void reserve(Scratch& s, const std::vector<Block>& blocks, int64_t T, int64_t hidden, int64_t terms) {
  int64_t floats = 0;
  for (const Block& b : blocks) {
    floats = std::max(floats, buffer_floats(b, T, hidden, terms));
    s.E = std::max(s.E, b.E);
    s.k = std::max(s.k, b.k);
    s.max_ff = std::max({s.max_ff, b.ff, b.shared_ff});
  }
  s.route.resize(T, s.E, s.k);
  s.f.resize(floats);
  s.T = T;
}

// [begin, end) of thread `tid`'s share of n items.
inline void share_of(int64_t n, int tid, int nt, int64_t& begin, int64_t& end) {
  begin = n * tid / nt;
  end = n * (tid + 1) / nt;
}

// Softmax, top-k, renormalisation and the grouping by expert, for all T rows (one thread).
inline void plan(const Block& b, int64_t T, Route& s) {
  const int64_t E = b.E, k = b.k;
  int64_t* ids = s.ids.data();
  float* w = s.w.data();
  int64_t* order = s.order.data();
  float* p = s.p.data();
  std::fill(s.start.begin(), s.start.begin() + E + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = s.logits.data() + t * E;
    const float top = *std::max_element(l, l + E);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - top));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order, order + k, order + E,
                      [&](int64_t a, int64_t c) { return p[a] > p[c] || (p[a] == p[c] && a < c); });
    float chosen = 0.0f;
    for (int64_t j = 0; j < k; ++j) chosen += p[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      ids[t * k + j] = order[j];
      w[t * k + j] = b.norm ? p[order[j]] / chosen : p[order[j]];
      ++s.start[order[j] + 1];
    }
  }
  for (int64_t e = 0; e < E; ++e) s.start[e + 1] += s.start[e];
  std::copy(s.start.begin(), s.start.begin() + E, s.next.begin());
  // Grouped rows in token order within each expert (moe.py's stable sort); a token's own slots are
  // then listed by ascending expert id, the order its outputs are added in.
  int64_t* js = s.js.data();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* mine = ids + t * k;
    for (int64_t j = 0; j < k; ++j) js[j] = j;
    std::sort(js, js + k, [&](int64_t a, int64_t c) { return mine[a] < mine[c]; });
    for (int64_t n = 0; n < k; ++n) {
      const int64_t j = js[n], e = mine[j], row = s.next[e]++;
      s.token[row] = t;
      s.weights[row] = w[t * k + j];
      s.slot[t * k + n] = row;
    }
  }
}

// The weight's column blocks from `nb` on, as a weight of its own (the kernels index blocks from 0).
inline tm_vnni::Weights from_block(const tm_vnni::Weights& w, int64_t nb) {
  tm_vnni::Weights v = w;
  const int64_t scale_rows = w.G / tm_vnni::fmt_scale_groups(w.fmt);  // scale records per block
  v.codes += nb * w.G * w.bits * 64;
  if (tm_vnni::fmt_fp16_scales(w.fmt)) v.scales += nb * scale_rows * tm_vnni::kCols;
  if (w.mins != nullptr) v.mins += nb * scale_rows * tm_vnni::kCols;
  if (tm_vnni::fmt_has_subs(w.fmt)) v.subs += nb * scale_rows * tm_vnni::fmt_subs(w.fmt) * tm_vnni::kCols;
  return v;
}

// Rows m0.. of rounded activations, as activations whose row 0 is m0 (the layout is group-major:
// the row stride inside a group stays M).
template <int Terms>
inline tm_vnni::Acts rows_from(const tm_vnni::Acts& a, int64_t m0) {
  return tm_vnni::Acts{a.xq + m0 * Terms * tm_vnni::kGroup, a.dx + m0 * Terms, a.qsum + m0,
                       a.msum + m0 * tm_vnni::kMergedSums, a.hqsum + m0 * 2, a.M};
}

// Row records of `src` (T rows) copied to rows r0..r1 of `dst` (R rows): row r is token[r]'s.
template <int Terms>
inline void gather_rows(const tm_vnni::Acts& src, const int64_t* token, int64_t G, int64_t r0, int64_t r1,
                        const tm_vnni::Acts& dst) {
  const int64_t T = src.M, R = dst.M;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = g * T + token[r], o = g * R + r;
      std::memcpy(dst.xq + o * Terms * tm_vnni::kGroup, src.xq + i * Terms * tm_vnni::kGroup, Terms * tm_vnni::kGroup);
      std::memcpy(dst.dx + o * Terms, src.dx + i * Terms, Terms * sizeof(float));
      dst.qsum[o] = src.qsum[i];
      std::memcpy(dst.msum + o * tm_vnni::kMergedSums, src.msum + i * tm_vnni::kMergedSums,
                  tm_vnni::kMergedSums * sizeof(int32_t));
      std::memcpy(dst.hqsum + o * 2, src.hqsum + i * 2, 2 * sizeof(float));
    }
  }
}

// Unit u (columns 128 u ..) of one expert's n rows (`a`, from row 0): gate and up blocks, SiLU(gate)
// * up, rounded into rows row0.. of `mid` (K = ff). `buf` holds n x (2 x 128 + 128) floats.
template <class Kit, int Terms>
inline void gate_up_unit(const Expert& x, int64_t ff, const tm_vnni::Acts& a, int64_t n, int64_t u, int64_t row0,
                         const tm_vnni::Acts& mid, float* buf) {
  const int64_t c0 = u * kUnitCols, width = std::min(ff, c0 + kUnitCols) - c0, nb = width / tm_vnni::kCols;
  float* gu = buf;                 // [n, 2 width]: gate | up, the layout silu_mul_rows takes
  float* act = buf + n * 2 * width;  // [n, width]
  Kit::blocks(from_block(x.gate_up, c0 / tm_vnni::kCols), a, 0, n, 2 * width, 0, nb, gu);
  Kit::blocks(from_block(x.gate_up, (ff + c0) / tm_vnni::kCols), a, 0, n, 2 * width, 0, nb, gu + width);
  Kit::silu_mul(gu, width, act, 0, n);
  const int64_t G = ff / tm_vnni::kGroup, g0 = c0 / tm_vnni::kGroup, g1 = g0 + width / tm_vnni::kGroup;
  for (int64_t r = 0; r < n; ++r) Kit::quantize_span(act + r * width, G, g0, g1, row0 + r, mid);
}

// The block's output for the T rows of h (normed, fp32 [T, hidden]; a_hidden its rounded rows) into
// delta [T, hidden]. Called by every thread of the team; separates its phases by barriers itself
// and leaves delta's columns to the threads that wrote them (the caller's barrier follows).
template <class Kit, int Terms = tm_step::kTerms>
inline void ffn(const Block& b, Scratch& s, const float* h, const tm_vnni::Acts& a_hidden, int64_t hidden,
                float* delta, int tid, int nt) {
  const int64_t T = s.T, E = b.E, R = T * b.k, ff = b.ff, sf = b.shared_ff;
  Local& mine = local();
  const bool private_route = T * E * hidden <= kPrivateRouterMACs;
  Route& route = private_route ? mine.route : s.route;
  if (private_route) {
    route.resize(T, s.E, s.k);
    for (int64_t i = 0; i < T * E; ++i)
      route.logits[i] = Kit::dot(h + (i / E) * hidden, b.router + (i % E) * hidden, hidden);
    plan(b, T, route);
  } else {
    int64_t p0, p1;
    share_of(T * E, tid, nt, p0, p1);
    for (int64_t i = p0; i < p1; ++i)
      route.logits[i] = Kit::dot(h + (i / E) * hidden, b.router + (i % E) * hidden, hidden);
#pragma omp barrier
#pragma omp single
    plan(b, T, route);
    // (implicit barrier of `single`)
  }
  float* down = s.f.data();  // [R, hidden]
  float* rows_base = down + R * hidden;
  const tm_vnni::Acts a_rows = tm_vnni::make_acts(rows_base, R, hidden, Terms);
  float* mid_base = rows_base + tm_vnni::acts_floats(R, hidden, Terms);
  const tm_vnni::Acts a_mid = tm_vnni::make_acts(mid_base, R, ff, Terms);
  float* s_down = mid_base + tm_vnni::acts_floats(R, ff, Terms);  // [T, hidden]
  const tm_vnni::Acts a_shared_mid = b.has_shared ? tm_vnni::make_acts(s_down + T * hidden, T, sf, Terms) : a_mid;
  // At T = 1 every expert's one row is a_hidden's row; else each expert's rows are gathered.
  const bool direct = T == 1;
  if (!direct) {
    int64_t r0, r1;
    share_of(R, tid, nt, r0, r1);
    gather_rows<Terms>(a_hidden, route.token.data(), hidden / tm_vnni::kGroup, r0, r1, a_rows);
#pragma omp barrier
  }
  // Phase 1: units of every active expert, then of the shared expert, cut evenly.
  const int64_t units = (ff + kUnitCols - 1) / kUnitCols;
  const int64_t shared_units = b.has_shared ? (sf + kUnitCols - 1) / kUnitCols : 0;
  int64_t active = 0;
  for (int64_t e = 0; e < E; ++e) active += route.start[e + 1] > route.start[e];
  int64_t u0, u1;
  share_of(active * units + shared_units, tid, nt, u0, u1);
  mine.unit.resize(static_cast<size_t>(std::max<int64_t>(1, T) * 3 * kUnitCols));
  int64_t base = 0;
  for (int64_t e = 0; e < E && base < u1; ++e) {
    const int64_t r0 = route.start[e], r1 = route.start[e + 1];
    if (r0 == r1) continue;
    const tm_vnni::Acts a = direct ? a_hidden : rows_from<Terms>(a_rows, r0);
    for (int64_t u = std::max(u0, base); u < std::min(u1, base + units); ++u)
      gate_up_unit<Kit, Terms>(b.experts[e], ff, a, r1 - r0, u - base, r0, a_mid, mine.unit.data());
    base += units;
  }
  for (int64_t u = std::max(u0, base); u < std::min(u1, base + shared_units); ++u)
    gate_up_unit<Kit, Terms>(b.shared, sf, a_hidden, T, u - base, 0, a_shared_mid, mine.unit.data());
#pragma omp barrier
  // Phase 2: this thread's column blocks of every expert's down, then of the tokens' sums.
  int64_t b0, b1;
  share_of(hidden / tm_vnni::kCols, tid, nt, b0, b1);
  if (b0 == b1) return;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = route.start[e], r1 = route.start[e + 1];
    if (r0 < r1)
      Kit::blocks(b.experts[e].down, rows_from<Terms>(a_mid, r0), 0, r1 - r0, hidden, b0, b1, down + r0 * hidden);
  }
  if (b.has_shared) Kit::blocks(b.shared.down, a_shared_mid, 0, T, hidden, b0, b1, s_down);
  const int64_t c0 = b0 * tm_vnni::kCols, c1 = b1 * tm_vnni::kCols;
  for (int64_t t = 0; t < T; ++t) {
    float* out = delta + t * hidden;
    std::fill(out + c0, out + c1, 0.0f);
    for (int64_t n = 0; n < b.k; ++n) {
      const int64_t row = route.slot[t * b.k + n];
      const float w = route.weights[row];
      const float* y = down + row * hidden;
      for (int64_t i = c0; i < c1; ++i) out[i] += y[i] * w;
    }
    if (b.has_shared) {
      const float g = 1.0f / (1.0f + std::exp(-Kit::dot(h + t * hidden, b.shared_gate, hidden)));
      const float* y = s_down + t * hidden;
      for (int64_t i = c0; i < c1; ++i) out[i] += g * y[i];
    }
  }
}

}  // namespace tm_moe
