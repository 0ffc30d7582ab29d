#pragma once
// The phases of a one-row decode step (batch 1) in which every thread holds the row itself.
//
// Why: in decode_phases.h every row-wise step (RMSNorm and the residual add, RoPE and the K/V store,
// the rounding of activations for the next linear, the MLP's activation) runs on the thread that
// owns the row, and a barrier makes its result visible before the next linear, which every thread
// reads whole. At one row that is one thread working while the others wait, and a barrier each:
// ~10 a layer, where each costs a futex wake-up once a waiter has slept (GOMP_SPINCOUNT; ~50 us
// a barrier and thread under load, docs/benchmarks.md "Fused decode step at batch 1"). A row is a
// few KB, so here every thread computes those steps for itself, into its own copy (RowCopy): the
// residual stream, the normed row, the rounded activations, RoPE'd q and k. Only the linears'
// column blocks and the attention items are shared out, so a layer waits at a barrier only where
// a linear's or the attention's output is read whole: after qkv, attention, o, gate_up and down.
//
// The results are the same bits as the owner-thread phases': the same kernels on the same values
// (a copy changes no value), only computed by more threads. Each shared location still has one
// writer: a thread stores the K/V rows of the KV heads of its own attention items, just before it
// attends them (at one row an item is one whole KV head: the plan splits no run of one row).
//
// Needs decode_phases.h included first.

#include <cstring>
#include <vector>

namespace tm_step {

// One thread's copy of a one-row step's row-sized state (views of its part of the step's scratch).
struct RowCopy {
  int64_t rows;  // 1; a run-time value, so that the kernels below are called as the owner-thread phases
                 // call them (a literal 1 lets the compiler clone them with another reduction order)
  float *x, *h, *delta, *qk, *q, *k, *act;  // residual, normed row, o/down output, q|k before RoPE, after
  tm_vnni::Acts a_hidden, a_attn, a_inter;  // the row rounded for the next linear (one buffer, three views)
};

// Floats of one thread's RowCopy, a multiple of 16 (each copy starts on its own cache line).
inline int64_t row_copy_floats(const StackBase& s) {
  const int64_t max_k = std::max({s.hidden, s.inter, s.nq * s.hd});
  const int64_t n = 3 * s.hidden + 2 * (s.nq + s.nkv) * s.hd + s.inter + tm_vnni::acts_floats(1, max_k, kTerms);
  return (n + 15) / 16 * 16;
}

// Thread `tid`'s copy in `base` (team x row_copy_floats floats, 64-byte aligned); its residual
// starts as the step's input row.
inline RowCopy make_row_copy(const StackBase& s, float* base, int tid, const float* x, int64_t rows) {
  RowCopy r;
  r.rows = rows;
  const int64_t qk_n = (s.nq + s.nkv) * s.hd;
  r.x = base + tid * row_copy_floats(s);
  r.h = r.x + s.hidden;
  r.delta = r.h + s.hidden;
  r.qk = r.delta + s.hidden;
  r.q = r.qk + qk_n;
  r.k = r.q + s.nq * s.hd;
  r.act = r.qk + 2 * qk_n;
  float* acts = r.act + s.inter;
  r.a_hidden = tm_vnni::make_acts(acts, rows, s.hidden, kTerms);
  r.a_attn = tm_vnni::make_acts(acts, rows, s.nq * s.hd, kTerms);
  r.a_inter = tm_vnni::make_acts(acts, rows, s.inter, kTerms);
  std::memcpy(r.x, x, static_cast<size_t>(s.hidden) * sizeof(float));
  return r;
}

// Whether a step of T rows over `plan` can run the one-row phases (a long row's pages split between
// the threads included: row_attention_phase merges its parts).
inline bool one_row(int64_t T, const tm_attention::Plan&) {
  return T == 1;
}

// Early K/V: where the qkv linear's share of every thread (linear_share's column blocks) holds some KV
// heads' K and V columns whole, the thread that computed them also (k-norms,) RoPEs and stores them
// before the barrier that ends the qkv phase; the attention phase is then free to split one KV
// head's query heads between threads (Gemma 3 270M: one KV head, four query heads), since no thread
// waits for a K/V row another is storing. -1: a head's columns straddle two shares (no early K/V).
inline int kv_owner(const StackBase& st, const Linear& qkv, int64_t j, int team) {
  const int64_t nb = qkv.N / tm_vnni::kCols;
  const int64_t k0 = (st.nq + j) * st.hd / tm_vnni::kCols, v0 = (st.nq + st.nkv + j) * st.hd / tm_vnni::kCols;
  const int64_t n = (st.hd + tm_vnni::kCols - 1) / tm_vnni::kCols;
  for (int t = 0; t < team; ++t) {
    int64_t b0, b1;
    share(nb, t, team, b0, b1);
    if (b0 <= k0 && k0 + n <= b1 && b0 <= v0 && v0 + n <= b1 && st.hd % tm_vnni::kCols == 0) return t;
  }
  return -1;
}

// kv_owner of each KV head, or empty where some head has none (no early K/V).
inline std::vector<int> kv_owners(const StackBase& st, const Linear& qkv, int team) {
  std::vector<int> owners(static_cast<size_t>(st.nkv));
  for (int64_t j = 0; j < st.nkv; ++j)
    if ((owners[j] = kv_owner(st, qkv, j, team)) < 0) return {};
  return owners;
}

// The qkv linear's share; with early K/V (`owners`: kv_owner of each KV head) the K and V rows of
// the heads this thread computed, k-normed by `norm_k(float* head)` (gemma; a no-op elsewhere),
// RoPE'd and stored at `slot`. Then the barrier.
template <class Kit, class NormK>
inline void row_qkv_phase(const StackBase& st, Scratch& s, RowCopy& r, const Linear& qkv, const int* owners,
                          const float* cos, const float* sin, int64_t slot, void* k_cache, void* v_cache, Worker& w,
                          NormK norm_k) {
  linear_share<Kit>(qkv, r.a_hidden, r.rows, s.qkv, w.tid, w.team);
  const int64_t nq = st.nq, nkv = st.nkv, hd = st.hd;
  for (int64_t j = 0; owners != nullptr && j < nkv; ++j) {
    if (owners[j] != w.tid) continue;
    float* k = r.qk + (nq + j) * hd;
    std::memcpy(k, s.qkv + (nq + j) * hd, static_cast<size_t>(hd) * sizeof(float));
    norm_k(k);
    Kit::rope(k, 0, cos, sin, 0, 1, hd, r.q, r.k + j * hd, 0, r.rows);  // one k head
    const int64_t row = j * st.num_slots + slot;
    Kit::store_row(st.cache_format, r.k + j * hd, k_cache, row, hd);
    Kit::store_row(st.cache_format, s.qkv + (nq + nkv + j) * hd, v_cache, row, hd);
  }
  w.sync();
}

// RoPE of the row's q and k heads from `qk` (the first (nq + nkv) x hd values of the qkv row, maybe
// q/k-normed) into the thread's copy; the K and V rows of its attention items' KV heads stored at
// `slot`; those items attended from the copy's q into s.attn (shared, disjoint heads); then, after
// the barrier, the whole attention row rounded into the copy for o.
// With early K/V (`early`) the K/V rows are stored already and only q is RoPE'd here; one item of a
// head_dim the plain-loop kernel runs (attend_one_scalar: each query head on its own, so a subset of
// them gives the same bits) is then split by query heads between the threads.
template <class Kit>
inline void row_attention_phase(const StackBase& st, Scratch& s, RowCopy& r, const float* qk, const float* cos,
                                const float* sin, int64_t slot, tm_attention::Args la, tm_attention::RangeFn attend,
                                const tm_attention::Plan& plan, bool early, Worker& w) {
  const int64_t nq = st.nq, nkv = st.nkv, hd = st.hd;
  Kit::rope(qk, 0, cos, sin, nq, early ? 0 : nkv, hd, r.q, r.k, 0, r.rows);
  const int64_t num_items = plan.num_items(), chunk = (num_items + w.team - 1) / w.team;
  if (early && num_items == 1 && nkv == 1 && hd > 128 && w.team > 1) {
    int64_t g0, g1;
    share(nq, w.tid, w.team, g0, g1);
    la.group = g1 - g0;
    la.q = r.q + g0 * hd;
    la.out = s.attn + g0 * hd;
    if (g0 < g1) attend(la, 0, 1, w.scores.data(), w.acc.data());
    w.sync();
    Kit::quantize_rows(s.attn, nq * hd, 0, r.rows, r.a_attn);
    return;
  }
  const int64_t i0 = std::min(num_items, w.tid * chunk), i1 = std::min(num_items, i0 + chunk);
  for (int64_t i = i0; i < i1 && !early; ++i) {
    const int64_t* item = plan.items.data() + i * tm_attention::kItemFields;
    if (item[3] != item[4] - 1) continue;  // a row split in parts: its last part's item (the one that reads it) stores it
    const int64_t j = item[2], row = j * st.num_slots + slot;
    Kit::store_row(st.cache_format, r.k + j * hd, const_cast<void*>(la.k), row, hd);
    Kit::store_row(st.cache_format, s.qkv + (nq + nkv + j) * hd, const_cast<void*>(la.v), row, hd);
  }
  la.q = r.q;
  if (i0 < i1) attend(la, i0, i1, w.scores.data(), w.acc.data());
  w.sync();
  if (plan.partial_size > 0) {  // the parts of split rows merged by one thread
    if (w.tid == 0) tm_attention::merge_parts(plan, la.partial, s.attn, nq, nq / nkv, hd);
    w.sync();
  }
  Kit::quantize_rows(s.attn, nq * hd, 0, r.rows, r.a_attn);
}

// The gated MLP of the rounded row in the copy into s.delta: gate_up, act(gate, up) and its
// rounding in every thread, down.
template <class Kit, class Act>
inline void row_mlp_phase(const StackBase& st, Scratch& s, RowCopy& r, const Linear& gate_up, const Linear& down,
                          Worker& w, Act act) {
  linear_phase<Kit>(gate_up, r.a_hidden, r.rows, s.gu, w);
  act(s.gu, st.inter, r.act, 0, r.rows);
  Kit::quantize_rows(r.act, st.inter, 0, r.rows, r.a_inter);
  linear_phase<Kit>(down, r.a_inter, r.rows, s.delta, w);
}

// The step's output row (the final norm, computed in every copy) and the residual stream (the
// input row, updated in place as the owner-thread phases leave it), each written once.
inline void row_output(const StackBase& st, const RowCopy& r, float* x, float* out, const Worker& w) {
  if (w.tid != 0) return;
  std::memcpy(out, r.h, static_cast<size_t>(st.hidden) * sizeof(float));
  std::memcpy(x, r.x, static_cast<size_t>(st.hidden) * sizeof(float));
}

}  // namespace tm_step
