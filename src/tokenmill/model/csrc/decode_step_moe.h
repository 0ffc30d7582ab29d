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
//   gate_up and down weights (quant_vnni.h), SiLU(gate) * up between (fused_ops.h);
// - each token's weighted expert outputs added in ascending expert order (moe.py's order), then the
//   shared expert (Qwen2-MoE) times sigmoid(x . gate).
// Work is split as the step splits a linear: every active expert's column blocks form one list, cut
// evenly between the threads, so k experts of one token keep every thread busy.
//
// Needs quant_vnni.h and fused_ops.h included first (decode_step.cpp does).

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// Per-step scratch, sized for T rows of the largest block (filled in by `plan` in one thread).
struct Scratch {
  std::vector<float> logits, weights;  // [T, E]; each assignment's routing weight, in grouped order
  std::vector<int64_t> token, start;   // grouped assignment -> token; expert -> first grouped row (E + 1)
  std::vector<int64_t> slot;           // token * k + j -> grouped row of its j-th expert, ascending ids
  std::vector<float> f;                // gathered rows, activations, outputs (see `Buffers`)
  int64_t T = 0, R = 0;
};

inline int64_t buffer_floats(const Block& b, int64_t T, int64_t hidden, int64_t terms) {
  const int64_t R = T * b.k, sf = b.shared_ff;
  int64_t n = R * hidden + R * 2 * b.ff + R * b.ff + R * hidden;  // rows, gate_up, act, down
  n += tm_vnni::acts_floats(R, hidden, terms) + tm_vnni::acts_floats(R, b.ff, terms);
  if (b.has_shared) n += T * 2 * sf + T * sf + T * hidden + tm_vnni::acts_floats(T, sf, terms);
  return n + 64;
}

inline void reserve(Scratch& s, const std::vector<Block>& blocks, int64_t T, int64_t hidden, int64_t terms) {
  int64_t floats = 0, E = 0, k = 0;
  for (const Block& b : blocks) {
    floats = std::max(floats, buffer_floats(b, T, hidden, terms));
    E = std::max(E, b.E);
    k = std::max(k, b.k);
  }
  s.logits.resize(T * E);
  s.weights.resize(T * k);
  s.token.resize(T * k);
  s.start.resize(E + 1);
  s.slot.resize(T * k);
  s.f.resize(floats);
  s.T = T;
}

// [begin, end) of thread `tid`'s share of n items.
inline void share_of(int64_t n, int tid, int nt, int64_t& begin, int64_t& end) {
  begin = n * tid / nt;
  end = n * (tid + 1) / nt;
}

// Softmax, top-k, renormalisation and the grouping by expert, for all T rows (one thread).
inline void plan(const Block& b, Scratch& s) {
  const int64_t T = s.T, E = b.E, k = b.k;
  std::vector<int64_t> ids(static_cast<size_t>(T * k));
  std::vector<float> w(static_cast<size_t>(T * k));
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::vector<float> p(static_cast<size_t>(E));
  std::fill(s.start.begin(), s.start.begin() + E + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = s.logits.data() + t * E;
    const float top = *std::max_element(l, l + E);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - top));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.begin() + E,
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
  std::vector<int64_t> next(s.start.begin(), s.start.begin() + E);
  // Grouped rows in token order within each expert (moe.py's stable sort); a token's own slots are
  // then listed by ascending expert id, the order its outputs are added in.
  std::vector<int64_t> js(static_cast<size_t>(k));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* mine = ids.data() + t * k;
    for (int64_t j = 0; j < k; ++j) js[j] = j;
    std::sort(js.begin(), js.end(), [&](int64_t a, int64_t c) { return mine[a] < mine[c]; });
    for (int64_t n = 0; n < k; ++n) {
      const int64_t j = js[n], e = mine[j], row = next[e]++;
      s.token[row] = t;
      s.weights[row] = w[t * k + j];
      s.slot[t * k + n] = row;
    }
  }
  s.R = T * k;
}

// The column blocks of every active expert's `which` weight (0 gate_up, 1 down; `cols` wide) and of
// the shared expert's (`shared_cols` wide), as one list cut evenly between the threads. Routed rows
// come from `routed` (grouped order, y row stride `cols`), the shared expert's from `shared` (all T).
template <int Terms>
inline void expert_share(const Block& b, const Scratch& s, int which, const tm_vnni::Acts& routed,
                         const tm_vnni::Acts& shared, int64_t cols, int64_t shared_cols, float* y_routed,
                         float* y_shared, int tid, int nt) {
  const int64_t per_expert = cols / tm_vnni::kCols;
  const int64_t per_shared = b.has_shared ? shared_cols / tm_vnni::kCols : 0;
  int64_t total = per_shared;
  for (int64_t e = 0; e < b.E; ++e)
    if (s.start[e + 1] > s.start[e]) total += per_expert;
  int64_t u0, u1;
  share_of(total, tid, nt, u0, u1);
  int64_t base = 0;
  for (int64_t e = 0; e < b.E && base < u1; ++e) {
    const int64_t r0 = s.start[e], r1 = s.start[e + 1];
    if (r0 == r1) continue;
    const int64_t lo = std::max(u0, base), hi = std::min(u1, base + per_expert);
    if (lo < hi) {
      const tm_vnni::Weights& w = which == 0 ? b.experts[e].gate_up : b.experts[e].down;
      tm_vnni::blocks<Terms>(w, routed, r0, r1, cols, lo - base, hi - base, y_routed);
    }
    base += per_expert;
  }
  const int64_t lo = std::max(u0, base), hi = std::min(u1, base + per_shared);
  if (lo < hi) {
    const tm_vnni::Weights& w = which == 0 ? b.shared.gate_up : b.shared.down;
    tm_vnni::blocks<Terms>(w, shared, 0, s.T, shared_cols, lo - base, hi - base, y_shared);
  }
}

// fp32 dot product in 16 lanes (the router: E of these per token and layer; the compiler keeps a
// scalar reduction in one lane, since it may not reorder the additions).
TV_TARGET inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// The block's output for the T rows of h (normed, fp32 [T, hidden]; a_hidden its rounded rows) into
// delta [T, hidden]. Called by every thread of the team; separates its phases by barriers itself.
template <int Terms>
inline void ffn(const Block& b, Scratch& s, const float* h, const tm_vnni::Acts& a_hidden, int64_t hidden,
                float* delta, int tid, int nt) {
  const int64_t T = s.T, E = b.E, R = T * b.k, ff = b.ff, sf = b.shared_ff;
  // Router logits: (token, expert) pairs split between threads.
  int64_t p0, p1;
  share_of(T * E, tid, nt, p0, p1);
  for (int64_t i = p0; i < p1; ++i) s.logits[i] = dot(h + (i / E) * hidden, b.router + (i % E) * hidden, hidden);
#pragma omp barrier
#pragma omp single
  plan(b, s);
  // (implicit barrier of `single`)
  float* rows = s.f.data();
  float* gu = rows + R * hidden;
  float* act = gu + R * 2 * ff;
  float* down = act + R * ff;
  float* acts_base = down + R * hidden;
  const tm_vnni::Acts a_rows = tm_vnni::make_acts(acts_base, R, hidden, Terms);
  float* acts_mid_base = acts_base + tm_vnni::acts_floats(R, hidden, Terms);
  const tm_vnni::Acts a_mid = tm_vnni::make_acts(acts_mid_base, R, ff, Terms);
  float* s_gu = acts_mid_base + tm_vnni::acts_floats(R, ff, Terms);
  float* s_act = s_gu + T * 2 * sf;
  float* s_down = s_act + T * sf;
  float* s_acts_base = s_down + T * hidden;
  const tm_vnni::Acts a_shared_mid = tm_vnni::make_acts(s_acts_base, T, b.has_shared ? sf : tm_vnni::kGroup, Terms);
  int64_t r0, r1, t0, t1;
  share_of(R, tid, nt, r0, r1);
  share_of(T, tid, nt, t0, t1);
  for (int64_t r = r0; r < r1; ++r) std::copy(h + s.token[r] * hidden, h + (s.token[r] + 1) * hidden, rows + r * hidden);
  tm_vnni::quantize_rows<Terms>(rows, hidden, r0, r1, a_rows);
#pragma omp barrier
  expert_share<Terms>(b, s, 0, a_rows, a_hidden, 2 * ff, 2 * sf, gu, s_gu, tid, nt);
#pragma omp barrier
  tm_fused::silu_mul_rows_avx512(gu, ff, act, r0, r1);
  tm_vnni::quantize_rows<Terms>(act, ff, r0, r1, a_mid);
  if (b.has_shared) {
    tm_fused::silu_mul_rows_avx512(s_gu, sf, s_act, t0, t1);
    tm_vnni::quantize_rows<Terms>(s_act, sf, t0, t1, a_shared_mid);
  }
#pragma omp barrier
  expert_share<Terms>(b, s, 1, a_mid, a_shared_mid, hidden, hidden, down, s_down, tid, nt);
#pragma omp barrier
  for (int64_t t = t0; t < t1; ++t) {
    float* out = delta + t * hidden;
    std::fill(out, out + hidden, 0.0f);
    for (int64_t n = 0; n < b.k; ++n) {
      const int64_t row = s.slot[t * b.k + n];
      const float w = s.weights[row];
      const float* y = down + row * hidden;
      for (int64_t i = 0; i < hidden; ++i) out[i] += y[i] * w;
    }
    if (b.has_shared) {
      const float g = 1.0f / (1.0f + std::exp(-dot(h + t * hidden, b.shared_gate, hidden)));
      const float* y = s_down + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) out[i] += g * y[i];
    }
  }
}

}  // namespace tm_moe
