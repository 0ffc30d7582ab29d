#pragma once
// The layer phases every fused decode step runs (decode_step.cpp: the llama family, with MoE layers;
// decode_step_gemma.h: the gemma family), written once.
//
// Why: the families differ in a few places (where the norms sit, the activation, gemma's q/k norms,
// its per-layer RoPE table, slots and window) and agree on the rest: the qkv linear, RoPE and the
// K/V store, the attention share and the merge of split runs, rounding rows for the next linear, the
// o linear, the gated MLP, and the scratch buffer they all work in. Each stack's `run` reads as its
// family's sequence of these phases; a new family adds its differences, not a copy of the skeleton.
//
// Every phase is called by every thread of the step's one parallel region and ends with the step's
// barrier (step_barrier.h) where the next phase reads what this one wrote. The work is split as the
// unfused ops split it: column blocks for the linears, (row, KV head) items for attention, rows for
// the elementwise steps; the arithmetic is the kernels' (quant_vnni.h or quant_avx2.h,
// paged_attention.h, fused_ops.h), in the same order as op by op.
//
// Each phase is a template on the step's kit (decode_kits.h: the AVX512-VNNI or the AVX2 kernels).
//
// Needs fused_ops.h, paged_attention.h, quant_vnni.h and quant_avx2.h included first (decode_step.cpp
// does).

#include <omp.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <vector>

#include "cascade_attention.h"
#include "decode_kits.h"
#include "step_barrier.h"

namespace tm_step {

constexpr int64_t kTensorsPerPart = 4;  // codes, scales, mins, subs of each weight

// One of a linear's weights: its output columns [col0, col0 + N). A linear has several where a GGUF
// mixes types inside it (Q4_K_M's q and k in Q4_K, v in Q6_K); the fused step runs them as one.
struct Part {
  tm_vnni::Weights w;
  int64_t N, col0;
};

struct Linear {
  std::vector<Part> parts;
  int64_t N;
};

// [begin, end) of thread `tid`'s share of n items, as even as possible.
inline void share(int64_t n, int tid, int nt, int64_t& begin, int64_t& end) {
  begin = n * tid / nt;
  end = n * (tid + 1) / nt;
}

// The parts of the next linear of K inputs from `t` / `f` / `np` on (per part: codes, scales, mins,
// subs and a format; `np` counts the parts of each linear), advancing them. Each part's N is read
// off its codes (N x K x bits / 8 bytes).
inline Linear read_linear(const at::Tensor*& t, const int64_t*& f, const int64_t*& np, int64_t K, int64_t layer) {
  Linear l{{}, 0};
  for (int64_t j = 0; j < *np; ++j, t += kTensorsPerPart, ++f) {
    const int bits = tm_vnni::fmt_bits(static_cast<int>(*f));
    TORCH_CHECK(bits > 0, "layer ", layer, ": unknown weight format ", *f);
    const int64_t N = t[0].numel() * 8 / (K * bits);
    l.parts.push_back(Part{tm_vnni::check_shapes(t[0], t[1], t[2], t[3], *f, N, K), N, l.N});
    l.N += N;
  }
  ++np;
  return l;
}

// What both families' stacks hold and check alike; each family's stack adds its layers.
struct StackBase : torch::CustomClassHolder {
  std::vector<at::Tensor> keep;  // every tensor the raw pointers point into
  const float* final_norm = nullptr;
  int64_t hidden = 0, inter = 0, nq = 0, nkv = 0, hd = 0, num_slots = 0;
  double eps = 0, scale = 0;
  tm_kv::CacheFormat cache_format = tm_kv::kCacheF32;
  StepBarrier barrier;
  int64_t kit = kKitAvx512;  // whose kernels `run` calls (decode_kits.h)

  // The kernels' kit, the head layout, the final norm (whose size is the hidden size) and the caches'
  // format and slot count (from the first layer's K cache; bind_caches checks every layer's against them).
  void bind(int64_t kit_id, const std::vector<at::Tensor>& tensors, const at::Tensor& final_norm_in,
            const at::Tensor& cache0, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double rms_eps,
            double attn_scale) {
    TORCH_CHECK(kit_id == kKitAvx512 || kit_id == kKitAvx2, "kit must be 0 (AVX512-VNNI) or 1 (AVX2), not ", kit_id);
    TORCH_CHECK(kit_supported(kit_id), "the fused decode step's ",
                kit_id == kKitAvx2 ? Avx2Kit::kName : Avx512Kit::kName,
                " kernels do not run on this CPU (or TOKENMILL_CPU_ISA does not allow them)");
    kit = kit_id;
    nq = num_heads, nkv = num_kv_heads, hd = head_dim, eps = rms_eps, scale = attn_scale;
    TORCH_CHECK(nkv > 0 && nq % nkv == 0 && hd % 2 == 0 && hd <= 256, "unsupported head layout");
    hidden = final_norm_in.numel();
    TORCH_CHECK(final_norm_in.is_contiguous() && final_norm_in.scalar_type() == at::kFloat,
                "norm weights must be contiguous float32");
    keep = tensors;
    keep.push_back(final_norm_in);
    final_norm = final_norm_in.data_ptr<float>();
    cache_format = tm_kv::cache_format(cache0.scalar_type());
    num_slots = cache0.size(1);
  }

  void bind_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache0, int64_t layer) {
    for (const at::Tensor* c : {&k_cache, &v_cache})
      TORCH_CHECK(c->is_contiguous() && c->dim() == 3 && c->size(0) == nkv && c->size(1) == num_slots &&
                      c->size(2) == tm_kv::row_width(cache_format, hd) && c->scalar_type() == cache0.scalar_type(),
                  "layer ", layer, ": caches must be contiguous [num_kv_heads, slots, row] of one format");
    keep.push_back(k_cache);
    keep.push_back(v_cache);
  }

  void check_step(const at::Tensor& x, int64_t page_size) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == hidden,
                "x must be contiguous float32 [T, hidden]");
    TORCH_CHECK(page_size > 0 && num_slots % page_size == 0, "bad page size");
  }

  // kind: 0 `omp barrier`, 1 spin then sleep (step_barrier.h); spin_us: the spin budget; log: time
  // every barrier (barrier_stats reads the totals, which this resets).
  void set_barrier(int64_t kind, int64_t spin_us, bool log) {
    TORCH_CHECK(kind == kOmp || kind == kSpin, "barrier kind must be 0 (omp) or 1 (spin)");
    TORCH_CHECK(spin_us >= 0, "the spin budget must be >= 0 microseconds");
    barrier.kind = static_cast<BarrierKind>(kind);
    barrier.spin_ns = spin_us * 1000;
    barrier.logging = log;
    barrier.stats = BarrierStats{};
  }

  std::vector<double> barrier_stats() const { return barrier.stats.values(); }
};

// One buffer for every intermediate of a layer (reused by the next), and the rounded activations'
// views of it. `zero`: T rows of zeros where a family starts its first norm as x + 0 (else null).
struct Scratch {
  at::Tensor buffer;
  float *h, *delta, *zero, *qkv, *q, *attn, *k, *gu, *act, *partial;
  tm_vnni::Acts a_hidden, a_attn, a_inter;
};

// `hidden_int8`: the layers' normed inputs keep their int8 terms beside a split (a MoE layer's experts
// gather their rows from them).
inline Scratch make_scratch(const StackBase& s, int64_t T, int64_t partial_size, bool zero_rows,
                            const at::TensorOptions& options, bool amx_kit, bool hidden_int8) {
  const int64_t max_k = std::max({s.hidden, s.inter, s.nq * s.hd}), qkv_n = (s.nq + 2 * s.nkv) * s.hd;
  const int64_t n_h = T * s.hidden, n_qkv = T * qkv_n, n_q = T * s.nq * s.hd, n_k = T * s.nkv * s.hd,
                n_gu = T * 2 * s.inter, n_act = T * s.inter, n_acts = tm_vnni::acts_floats(T, max_k, kTerms);
  const int64_t n_zero = zero_rows ? n_h : 0;
  // A step of enough rows on a kit that runs AMX tiles where the CPU has them (Avx512Kit) also
  // splits its rows for them (quant_amx.h).
  const bool split = amx_kit && T >= tm_amx::kAmxMinRows && tm_amx::amx_ready();
  // Without AMX, a step of tm_amx::kVecMinRows+ rows splits them too, for its Q8_0 weights' one-term
  // vector tiles (quant_bf16_vec.h), as the op-by-op linear does; the other formats read the int8 terms.
  const bool vec = amx_kit && !split && T >= tm_amx::kVecMinRows && tm_amx::vec_ready();
  // (the vector tiles read hi alone: no lo term, no sums)
  const tm_amx::SplitNeeds needs = vec ? tm_amx::SplitNeeds{false, false} : tm_amx::SplitNeeds{};
  const int64_t n_split = split || vec ? tm_amx::split_floats(T, max_k, needs) + 16 : 0;
  // Fewer rows, from tm_amx8::kAmx8MinRows: each row also as two int8 terms per 256 inputs, for the
  // AMX-INT8 tiles of the formats that fold (quant_amx8.h), where K is whole super-blocks.
  const bool amx8 = amx_kit && !split && !vec && T >= tm_amx8::kAmx8MinRows && tm_amx8::ready();
  const int64_t n_amx8 = amx8 ? tm_amx8::acts8_floats(T, max_k) + 16 : 0;
  Scratch b;
  b.buffer = at::empty(
      {2 * n_h + n_zero + n_qkv + 2 * n_q + n_k + n_gu + n_act + n_acts + partial_size + n_split + n_amx8 + 16}, options);
  b.h = b.buffer.data_ptr<float>();  // normed input of the next linear
  b.delta = b.h + n_h;  // o_proj's, then down's output
  b.zero = zero_rows ? b.delta + n_h : nullptr;
  b.qkv = b.delta + n_h + n_zero;
  b.q = b.qkv + n_qkv;
  b.attn = b.q + n_q;
  b.k = b.attn + n_q;
  b.gu = b.k + n_k;
  b.act = b.gu + n_gu;
  b.partial = b.act + n_act;
  float* acts_base = b.partial + partial_size;
  if (zero_rows) std::fill(b.zero, b.zero + n_h, 0.0f);
  b.a_hidden = tm_vnni::make_acts(acts_base, T, s.hidden, kTerms);
  b.a_attn = tm_vnni::make_acts(acts_base, T, s.nq * s.hd, kTerms);
  b.a_inter = tm_vnni::make_acts(acts_base, T, s.inter, kTerms);
  float* tiles_base = tm_amx::align64(acts_base + n_acts);  // the split's or the AMX-INT8 terms' (one of them)
  if (split || vec) {
    b.a_hidden.split = tm_amx::make_split(tiles_base, T, s.hidden, needs);
    b.a_attn.split = tm_amx::make_split(tiles_base, T, s.nq * s.hd, needs);
    b.a_inter.split = tm_amx::make_split(tiles_base, T, s.inter, needs);
  }
  if (split) {
    b.a_hidden.int8 = hidden_int8;  // every other reader of these takes all T rows: the split
    b.a_attn.int8 = b.a_inter.int8 = false;
  }
  if (amx8) {
    for (auto [a, K] : {std::pair{&b.a_hidden, s.hidden}, {&b.a_attn, s.nq * s.hd}, {&b.a_inter, s.inter}})
      if (K % tm_amx8::kSuperInputs == 0) a->amx8 = tm_amx8::make_acts8(tiles_base, T, K);
  }
  return b;
}

// A thread of the step's team: its rows, its attention scratch, and its way through the barriers.
struct Worker {
  int tid, team;
  int64_t r0, r1;  // this thread's rows
  std::vector<float> scores, acc;
  Sync sync;

  Worker(int64_t T, int64_t scores_size, int64_t acc_size, StepBarrier& barrier, std::vector<BarrierLog>& logs)
      : tid(omp_get_thread_num()), team(omp_get_num_threads()), scores(static_cast<size_t>(scores_size)),
        acc(static_cast<size_t>(acc_size)), sync{&barrier, barrier.logging ? &logs[tid] : nullptr, team} {
    share(T, tid, team, r0, r1);
  }
};

// The team's logs for one step (empty when the stack is not logging), and the step's start.
struct StepLogs {
  std::vector<BarrierLog> logs;
  int64_t start;

  StepLogs(const StepBarrier& b, int nt) : logs(b.logging ? nt : 0), start(b.logging ? now_ns() : 0) {
    for (BarrierLog& l : logs) l.arrive.reserve(1024), l.depart.reserve(1024);  // no allocation while timed
  }
  void finish(StepBarrier& b) {
    if (b.logging) b.add(logs, now_ns() - start);
  }
};

// y[:, blocks of this thread] = a @ w^T: the thread's share of all the parts' column blocks.
template <class Kit>
inline void linear_share(const Linear& l, const tm_vnni::Acts& a, int64_t T, float* y, int tid, int nt) {
  int64_t b0, b1;
  share(l.N / tm_vnni::kCols, tid, nt, b0, b1);
  for (const Part& p : l.parts) {
    const int64_t p0 = p.col0 / tm_vnni::kCols, lo = std::max(b0, p0), hi = std::min(b1, p0 + p.N / tm_vnni::kCols);
    if (lo < hi) Kit::blocks(p.w, a, 0, T, l.N, lo - p0, hi - p0, y + p.col0);
  }
}

template <class Kit>
inline void linear_phase(const Linear& l, const tm_vnni::Acts& a, int64_t T, float* y, Worker& w) {
  linear_share<Kit>(l, a, T, y, w.tid, w.team);
  w.sync();
}

// The thread's rows of x [T, K] rounded for the next linear (none on the last layer's end).
template <class Kit>
inline void quantize_phase(const float* x, int64_t K, const tm_vnni::Acts& a, Worker& w, bool round = true) {
  if (round) Kit::quantize_rows(x, K, w.r0, w.r1, a);
  w.sync();
}

// RoPE of the thread's rows of q and k (from s.qkv into s.q / s.k), and their K and V into the
// layer's caches at the rows' slots.
template <class Kit>
inline void rope_store_phase(const StackBase& st, Scratch& s, const float* cos, const float* sin, const int64_t* slots,
                             void* k_cache, void* v_cache, Worker& w) {
  const int64_t nq = st.nq, nkv = st.nkv, hd = st.hd, qkv_n = (nq + 2 * nkv) * hd;
  Kit::rope(s.qkv, qkv_n, cos, sin, nq, nkv, hd, s.q, s.k, w.r0, w.r1);
  for (int64_t t = w.r0; t < w.r1; ++t) {
    for (int64_t j = 0; j < nkv; ++j) {
      const int64_t row = j * st.num_slots + slots[t];
      Kit::store_row(st.cache_format, s.k + (t * nkv + j) * hd, k_cache, row, hd);
      Kit::store_row(st.cache_format, s.qkv + t * qkv_n + (nq + nkv + j) * hd, v_cache, row, hd);
    }
  }
  w.sync();
}

// The thread's share of the attention items: the split at::parallel_for makes, contiguous chunks of
// ceil(n / team) items.
inline void attend_share(const tm_attention::Args& la, tm_attention::RangeFn attend, const tm_attention::Plan& plan,
                         Worker& w) {
  const int64_t num_items = plan.num_items(), chunk = (num_items + w.team - 1) / w.team;
  const int64_t i0 = std::min(num_items, w.tid * chunk), i1 = std::min(num_items, i0 + chunk);
  if (i0 < i1) attend(la, i0, i1, w.scores.data(), w.acc.data());
}

// The thread's share of the items, the merge of split runs by one thread, then the rows rounded for o.
template <class Kit>
inline void attention_phase(const StackBase& st, Scratch& s, const tm_attention::Args& la,
                            tm_attention::RangeFn attend, const tm_attention::Plan& plan, Worker& w) {
  attend_share(la, attend, plan, w);
  w.sync();
  if (plan.partial_size > 0) {
    if (w.sync.barrier->kind == kOmp) {
#pragma omp single nowait
      tm_attention::merge_parts(plan, s.partial, s.attn, st.nq, st.nq / st.nkv, st.hd);
    } else if (w.tid == 0) {
      tm_attention::merge_parts(plan, s.partial, s.attn, st.nq, st.nq / st.nkv, st.hd);
    }
    w.sync();
  }
  quantize_phase<Kit>(s.attn, st.nq * st.hd, s.a_attn, w);
}

#if TM_AMX_COMPILES
// The attention phase of a cascade step (cascade_attention.h; attention_phase otherwise): the groups'
// prefix K / V tiles packed and the rows' queries rounded, shared out; the thread's chunk of the rows'
// own items, then every group's prefix items taken from the group's counter for `layer` until none is
// left; each thread merges its rows and rounds them for o.
template <class Kit>
inline void cascade_attention_phase(const StackBase& st, Scratch& s, const tm_attention::Args& la,
                                    tm_attention::RangeFn attend, const tm_attention::Plan& plan,
                                    const tm_cascade::Plan& p, tm_cascade::Work& cw, tm_kv::CacheFormat format,
                                    int64_t layer, Worker& w) {
  tm_flash::Problem pr[tm_cascade::kMaxGroups];
  tm_cascade::problems(p, cw, la, format, pr);
  const int64_t units = tm_cascade::pack_units(p, st.nkv), C = static_cast<int64_t>(p.rows.size());
  for (int64_t u = w.tid; u < units; u += w.team) tm_cascade::pack_unit(cw, pr, st.nkv, u);
  int64_t c0, c1;
  share(C, w.tid, w.team, c0, c1);
  tm_cascade::round_queries(p, cw, s.q, st.nq, st.hd, c0, c1);
  w.sync();
  attend_share(la, attend, plan, w);
  tm_cascade::run_groups(p, cw, pr, layer, *cw.scratch[w.tid]);
  w.sync();
  for (int64_t t = w.r0; t < w.r1; ++t) tm_cascade::merge_row(p, cw, s.attn, t, st.nq, st.hd);
  quantize_phase<Kit>(s.attn, st.nq * st.hd, s.a_attn, w);
}

#endif

// The gated MLP from the rounded s.h into s.delta: gate_up, act(gate, up) on the thread's rows
// (Act: void(const float* gu, int64_t inter, float* out, int64_t t0, int64_t t1)), rounded, down.
template <class Kit, class Act>
inline void mlp_phase(const StackBase& st, Scratch& s, const Linear& gate_up, const Linear& down, int64_t T, Worker& w,
                      Act act) {
  linear_phase<Kit>(gate_up, s.a_hidden, T, s.gu, w);
  act(s.gu, st.inter, s.act, w.r0, w.r1);
  quantize_phase<Kit>(s.act, st.inter, s.a_inter, w);
  linear_phase<Kit>(down, s.a_inter, T, s.delta, w);
}

}  // namespace tm_step
