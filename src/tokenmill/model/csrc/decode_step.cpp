// A whole decode step's layer stack in one call and one OpenMP parallel region, for the fast path.
//
// Why: batch-1 decode runs ~8 ops a layer (240 a token), each a Python call, a dispatcher trip and,
// for the linears, a fork and join of the thread team; the 121 small matrix-vector products read
// their weights at ~21 GB/s where one large call reaches ~45 (docs/benchmarks.md). llama.cpp keeps one
// thread team for the whole graph and separates its ops by barriers; this does the same: the team is
// forked once per step, and the phases of each layer are separated by `omp barrier`s, a microsecond
// each while the threads spin (GOMP_SPINCOUNT covers the gaps inside a step).
//
// The arithmetic is the unfused fast path's, from the same code (the headers): rows rounded to two
// int8 terms and multiplied by the column-blocked VNNI kernel (quant_vnni.h), RoPE and the K/V store,
// paged decode attention (paged_attention.h), the residual add + RMSNorm and SiLU * up (fused_ops.h).
// The work of each phase is split between threads as the unfused ops split it: column blocks for the
// linears, (row, KV head) items for attention, rows for the elementwise steps.
//
// Layer weights are bound once (DecodeStack, a TorchScript class held by model/fused_decode.py); a
// step passes only what changes: the residual stream, cos/sin, slots, block table and lengths.

#include "fused_ops.h"
#include "paged_attention.h"
#include "quant_vnni.h"
#include "decode_step_moe.h"

#include <omp.h>

#include <torch/custom_class.h>

namespace {

constexpr int64_t kTerms = 2;  // int8 terms per activation (two: near fp32 quality, see quant_vnni.h)
constexpr int64_t kNormsPerLayer = 2;   // then codes, scales, mins, subs of each part of qkv, o, gate_up, down
constexpr int64_t kTensorsPerPart = 4;

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

struct Layer {
  const float* input_norm;
  const float* post_norm;
  Linear qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
  int64_t moe = -1;  // index into DecodeStack::moe_blocks where the layer's MLP is routed experts
};

// [begin, end) of thread `tid`'s share of n items, as even as possible.
inline void share(int64_t n, int tid, int nt, int64_t& begin, int64_t& end) {
  begin = n * tid / nt;
  end = n * (tid + 1) / nt;
}

// y[:, blocks of this thread] = a @ w^T: the thread's share of all the parts' column blocks.
inline void linear_share(const Linear& l, const tm_vnni::Acts& a, int64_t T, float* y, int tid, int nt) {
  int64_t b0, b1;
  share(l.N / tm_vnni::kCols, tid, nt, b0, b1);
  for (const Part& p : l.parts) {
    const int64_t p0 = p.col0 / tm_vnni::kCols, lo = std::max(b0, p0), hi = std::min(b1, p0 + p.N / tm_vnni::kCols);
    if (lo < hi) tm_vnni::blocks<kTerms>(p.w, a, 0, T, l.N, lo - p0, hi - p0, y + p.col0);
  }
}

struct DecodeStack : torch::CustomClassHolder {
  std::vector<at::Tensor> keep;  // every tensor the raw pointers below point into
  std::vector<Layer> layers;
  const float* final_norm = nullptr;
  int64_t hidden = 0, inter = 0, nq = 0, nkv = 0, hd = 0, num_slots = 0;
  double eps = 0, scale = 0;
  tm_kv::CacheFormat cache_format = tm_kv::kCacheF32;
  std::vector<tm_moe::Block> moe_blocks;

  DecodeStack(std::vector<at::Tensor> tensors, std::vector<int64_t> formats, std::vector<int64_t> parts,
              std::vector<at::Tensor> k_caches,
              std::vector<at::Tensor> v_caches, at::Tensor final_norm_in, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, double rms_eps, double attn_scale) {
    TORCH_CHECK(tm_fused::use_avx512() && tm_vnni::vnni_supported(), "the fused decode step needs AVX512-VNNI");
    const int64_t L = static_cast<int64_t>(k_caches.size());
    int64_t total_parts = 0;
    for (const int64_t n : parts) {
      TORCH_CHECK(n >= 0, "a linear has no negative number of weights");
      total_parts += n;
    }
    TORCH_CHECK(L > 0 && static_cast<int64_t>(parts.size()) == 4 * L && static_cast<int64_t>(v_caches.size()) == L &&
                    static_cast<int64_t>(formats.size()) == total_parts &&
                    static_cast<int64_t>(tensors.size()) == L * kNormsPerLayer + total_parts * kTensorsPerPart,
                "expected per layer 2 norms, 4 linears of 4 tensors and a format per part, a K and V cache");
    nq = num_heads, nkv = num_kv_heads, hd = head_dim, eps = rms_eps, scale = attn_scale;
    TORCH_CHECK(nkv > 0 && nq % nkv == 0 && hd % 2 == 0 && hd <= 256, "unsupported head layout");
    hidden = final_norm_in.numel();
    TORCH_CHECK(final_norm_in.is_contiguous() && final_norm_in.scalar_type() == at::kFloat,
                "norm weights must be contiguous float32");
    keep = tensors;
    keep.push_back(final_norm_in);
    final_norm = final_norm_in.data_ptr<float>();
    const at::Tensor& c0 = k_caches[0];
    cache_format = tm_kv::cache_format(c0.scalar_type());
    num_slots = c0.size(1);
    const int64_t qkv_n = (nq + 2 * nkv) * hd;
    const at::Tensor* t = tensors.data();
    const int64_t* f = formats.data();
    const int64_t* np = parts.data();
    for (int64_t i = 0; i < L; ++i) {
      for (int j = 0; j < 2; ++j)
        TORCH_CHECK(t[j].is_contiguous() && t[j].scalar_type() == at::kFloat && t[j].numel() == hidden,
                    "layer ", i, ": norm weights must be contiguous float32 [hidden]");
      for (const at::Tensor* c : {&k_caches[i], &v_caches[i]})
        TORCH_CHECK(c->is_contiguous() && c->dim() == 3 && c->size(0) == nkv && c->size(1) == num_slots &&
                        c->size(2) == tm_kv::row_width(cache_format, hd) && c->scalar_type() == c0.scalar_type(),
                    "layer ", i, ": caches must be contiguous [num_kv_heads, slots, row] of one format");
      const at::Tensor* norms = t;
      t += kNormsPerLayer;
      // The parts of the next linear, each part's N read off its codes (N x K x bits / 8 bytes).
      auto linear = [&](int64_t K) {
        Linear l{{}, 0};
        for (int64_t j = 0; j < *np; ++j, t += kTensorsPerPart, ++f) {
          const int bits = tm_vnni::fmt_bits(static_cast<int>(*f));
          TORCH_CHECK(bits > 0, "layer ", i, ": unknown weight format ", *f);
          const int64_t N = t[0].numel() * 8 / (K * bits);
          l.parts.push_back(Part{tm_vnni::check(t[0], t[1], t[2], t[3], *f, N, K), N, l.N});
          l.N += N;
        }
        ++np;
        return l;
      };
      Linear qkv_l = linear(hidden), o_l = linear(nq * hd), gate_up_l = linear(hidden);
      if (inter == 0) inter = gate_up_l.N / 2;
      Linear down_l = linear(inter);
      // A layer without gate_up and down has routed experts, bound by set_moe.
      const bool dense = gate_up_l.N == 2 * inter && down_l.N == hidden;
      TORCH_CHECK(qkv_l.N == qkv_n && o_l.N == hidden && (dense || (gate_up_l.N == 0 && down_l.N == 0)),
                  "layer ", i, ": linear sizes do not match the heads, hidden and intermediate sizes");
      Layer layer{norms[0].data_ptr<float>(), norms[1].data_ptr<float>(), std::move(qkv_l), std::move(o_l),
                  std::move(gate_up_l), std::move(down_l), k_caches[i].data_ptr(), v_caches[i].data_ptr()};
      layers.push_back(std::move(layer));
      keep.push_back(k_caches[i]);
      keep.push_back(v_caches[i]);
    }
  }

  // Layer `index`'s MLP as routed experts (csrc/decode_step_moe.h): `tensors` holds per expert its
  // gate_up then its down weight (codes, scales, mins, subs each, one blocked format per weight in
  // `formats`), then the shared expert's two when `shared_gate` (fp32 [hidden]) is not empty;
  // `router` is fp32 [experts, hidden].
  void set_moe(int64_t index, std::vector<at::Tensor> tensors, std::vector<int64_t> formats, at::Tensor router,
               at::Tensor shared_gate, int64_t top_k, bool norm) {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers.size()), "no layer ", index);
    Layer& layer = layers[index];
    TORCH_CHECK(layer.gate_up.N == 0 && layer.moe < 0, "layer ", index, " already has an MLP");
    TORCH_CHECK(router.is_contiguous() && router.scalar_type() == at::kFloat && router.dim() == 2 &&
                    router.size(1) == hidden, "the router must be contiguous float32 [experts, hidden]");
    tm_moe::Block b;
    b.E = router.size(0), b.k = top_k, b.norm = norm, b.router = router.data_ptr<float>();
    b.has_shared = shared_gate.numel() > 0;
    const int64_t weights = 2 * (b.E + (b.has_shared ? 1 : 0));
    TORCH_CHECK(top_k >= 1 && top_k <= b.E, "top_k must be in 1..experts");
    TORCH_CHECK(static_cast<int64_t>(formats.size()) == weights &&
                    static_cast<int64_t>(tensors.size()) == weights * kTensorsPerPart,
                "expected gate_up and down (4 tensors, a format each) per expert and shared expert");
    auto weight = [&](int64_t j, int64_t K, int64_t& N) {
      const at::Tensor* t = tensors.data() + j * kTensorsPerPart;
      const int bits = tm_vnni::fmt_bits(static_cast<int>(formats[j]));
      TORCH_CHECK(bits > 0, "unknown weight format ", formats[j]);
      N = t[0].numel() * 8 / (K * bits);
      return tm_vnni::check(t[0], t[1], t[2], t[3], formats[j], N, K);
    };
    auto expert = [&](int64_t j, int64_t& ff) {
      int64_t n_gu = 0, n_down = 0;
      tm_moe::Expert e{weight(j, hidden, n_gu), {}};
      ff = n_gu / 2;
      e.down = weight(j + 1, ff, n_down);
      TORCH_CHECK(n_gu == 2 * ff && n_down == hidden && ff % tm_vnni::kCols == 0, "layer ", index,
                  ": expert sizes do not match the hidden size");
      return e;
    };
    for (int64_t e = 0; e < b.E; ++e) {
      int64_t ff = 0;
      b.experts.push_back(expert(2 * e, ff));
      TORCH_CHECK(e == 0 || ff == b.ff, "layer ", index, ": experts of different widths");
      b.ff = ff;
    }
    if (b.has_shared) {
      TORCH_CHECK(shared_gate.is_contiguous() && shared_gate.scalar_type() == at::kFloat &&
                      shared_gate.numel() == hidden, "the shared expert's gate must be contiguous float32 [hidden]");
      b.shared = expert(2 * b.E, b.shared_ff);
      b.shared_gate = shared_gate.data_ptr<float>();
      keep.push_back(shared_gate);
    }
    keep.insert(keep.end(), tensors.begin(), tensors.end());
    keep.push_back(router);
    layer.moe = static_cast<int64_t>(moe_blocks.size());
    moe_blocks.push_back(std::move(b));
  }

  // x [T, hidden] (the embeddings; updated in place as the residual stream), cos/sin [T, hd] per
  // row, slots [T], block table [T, max_pages] and lengths [T] of the rows' sequences (every row a
  // decode row; consecutive rows of one sequence form runs). Returns the final norm's output.
  at::Tensor run(at::Tensor x, at::Tensor cos_in, at::Tensor sin_in, at::Tensor slots_in, at::Tensor table_in,
                 at::Tensor lens_in, int64_t page_size) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == hidden,
                "x must be contiguous float32 [T, hidden]");
    const int64_t T = x.size(0);
    const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
    TORCH_CHECK(cos.numel() == T * hd && sin.numel() == T * hd && cos.scalar_type() == at::kFloat,
                "cos and sin must be float32 [T, head_dim]");
    const at::Tensor slots = slots_in.to(at::kLong).contiguous();
    const at::Tensor table = table_in.to(at::kLong).contiguous();
    const at::Tensor lens = lens_in.to(at::kLong).contiguous();
    TORCH_CHECK(slots.numel() == T && lens.numel() == T && table.dim() == 2 && table.size(0) == T,
                "one slot, length and block-table row per row");
    TORCH_CHECK(page_size > 0 && num_slots % page_size == 0, "bad page size");
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " is outside the cache");
    const int nt = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
    const tm_attention::Isa isa = tm_attention::selected_isa(-1);
    // Checks every page id and length: nothing inside the parallel region can fail.
    const tm_attention::Plan plan = tm_attention::make_plan(table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), T,
                                                            table.size(1), page_size, num_slots / page_size, nq,
                                                            nkv, hd, isa, nt);
    const int64_t group = nq / nkv;
    const int64_t qkv_n = (nq + 2 * nkv) * hd;

    at::Tensor out = at::empty({T, hidden}, x.options());
    if (T == 0) return out;
    for (const Layer& l : layers) TORCH_CHECK(l.gate_up.N > 0 || l.moe >= 0, "a layer has no MLP");
    tm_moe::Scratch moe_scratch;
    if (!moe_blocks.empty()) tm_moe::reserve(moe_scratch, moe_blocks, T, hidden, kTerms);
    // One buffer for every intermediate of a layer (reused by the next).
    const int64_t max_k = std::max({hidden, inter, nq * hd});
    const int64_t n_h = T * hidden, n_qkv = T * qkv_n, n_q = T * nq * hd, n_k = T * nkv * hd, n_gu = T * 2 * inter,
                  n_act = T * inter, n_acts = tm_vnni::acts_floats(T, max_k, kTerms);
    at::Tensor buffer = at::empty({3 * n_h + n_qkv + 2 * n_q + n_k + n_gu + n_act + n_acts + plan.partial_size + 16},
                                  x.options());
    float* p = buffer.data_ptr<float>();
    float* h = p;  // normed input of the next linear
    float* delta = h + n_h;  // o_proj's, then down's output
    float* zero = delta + n_h;  // x + 0: the first layer's norm through add_rms_norm
    float* qkv = zero + n_h;
    float* q = qkv + n_qkv;
    float* attn = q + n_q;
    float* k = attn + n_q;
    float* gu = k + n_k;
    float* act = gu + n_gu;
    float* partial = act + n_act;
    float* acts_base = partial + plan.partial_size;
    std::fill(zero, zero + n_h, 0.0f);

    float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* snp = sin.data_ptr<float>();
    const tm_vnni::Acts a_hidden = tm_vnni::make_acts(acts_base, T, hidden, kTerms);
    const tm_vnni::Acts a_attn = tm_vnni::make_acts(acts_base, T, nq * hd, kTerms);
    const tm_vnni::Acts a_inter = tm_vnni::make_acts(acts_base, T, inter, kTerms);

    const int64_t row_elems = tm_kv::row_width(cache_format, hd);
    const tm_attention::Args args =
        tm_attention::make_args(plan, q, attn, partial, table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                table.size(1), page_size, nq, nkv, hd, static_cast<float>(scale),
                                num_slots * row_elems, row_elems);
    // The AVX-512 variant only (the constructor checked for it): the others are then never compiled
    // into this library, which keeps its build short.
    const tm_attention::RangeFn attend = tm_attention::avx512_fns[cache_format];
    const int64_t num_items = plan.num_items();
    const float e = static_cast<float>(eps);
    const int64_t L = static_cast<int64_t>(layers.size());

#pragma omp parallel num_threads(nt)
    {
      const int tid = omp_get_thread_num(), team = omp_get_num_threads();
      std::vector<float> scores(static_cast<size_t>(plan.scores_size));
      std::vector<float> acc(static_cast<size_t>(group * hd));
      int64_t r0, r1;  // this thread's rows
      share(T, tid, team, r0, r1);
      tm_fused::add_rms_norm_rows_avx512(xp, zero, layers[0].input_norm, hidden, e, h, r0, r1);
      tm_vnni::quantize_rows<kTerms>(h, hidden, r0, r1, a_hidden);
#pragma omp barrier
      for (int64_t i = 0; i < L; ++i) {
        const Layer& l = layers[i];
        linear_share(l.qkv, a_hidden, T, qkv, tid, team);
#pragma omp barrier
        tm_fused::rope_rows_avx512(qkv, qkv_n, cp, snp, nq, nkv, hd, q, k, r0, r1);
        for (int64_t t = r0; t < r1; ++t) {
          for (int64_t j = 0; j < nkv; ++j) {
            const float* ks = k + (t * nkv + j) * hd;
            const float* vs = qkv + t * qkv_n + (nq + nkv + j) * hd;
            const int64_t row = j * num_slots + sp[t];
            tm_fused::store_cache_row(true, cache_format, ks, l.k_cache, row, hd);
            tm_fused::store_cache_row(true, cache_format, vs, l.v_cache, row, hd);
          }
        }
#pragma omp barrier
        {
          tm_attention::Args la = args;
          la.k = l.k_cache;
          la.v = l.v_cache;
          // the split at::parallel_for makes: contiguous chunks of ceil(n / team) items
          const int64_t chunk = (num_items + team - 1) / team;
          const int64_t i0 = std::min(num_items, tid * chunk), i1 = std::min(num_items, i0 + chunk);
          if (i0 < i1) attend(la, i0, i1, scores.data(), acc.data());
#pragma omp barrier
          if (plan.partial_size > 0) {
#pragma omp single
            tm_attention::merge_parts(plan, partial, attn, nq, group, hd);
          }
        }
        tm_vnni::quantize_rows<kTerms>(attn, nq * hd, r0, r1, a_attn);
#pragma omp barrier
        linear_share(l.o, a_attn, T, delta, tid, team);
#pragma omp barrier
        tm_fused::add_rms_norm_rows_avx512(xp, delta, l.post_norm, hidden, e, h, r0, r1);
        tm_vnni::quantize_rows<kTerms>(h, hidden, r0, r1, a_hidden);
#pragma omp barrier
        if (l.moe < 0) {
          linear_share(l.gate_up, a_hidden, T, gu, tid, team);
#pragma omp barrier
          tm_fused::silu_mul_rows_avx512(gu, inter, act, r0, r1);
          tm_vnni::quantize_rows<kTerms>(act, inter, r0, r1, a_inter);
#pragma omp barrier
          linear_share(l.down, a_inter, T, delta, tid, team);
        } else {
          tm_moe::ffn<kTerms>(moe_blocks[l.moe], moe_scratch, h, a_hidden, hidden, delta, tid, team);
        }
#pragma omp barrier
        const bool last = i + 1 == L;
        tm_fused::add_rms_norm_rows_avx512(xp, delta, last ? final_norm : layers[i + 1].input_norm, hidden, e,
                                           last ? op : h, r0, r1);
        if (!last) tm_vnni::quantize_rows<kTerms>(h, hidden, r0, r1, a_hidden);
#pragma omp barrier
      }
    }
    return out;
  }
};

}  // namespace

#include "decode_step_gemma.h"  // the gemma family's stack, over Part / Linear / linear_share above

TORCH_LIBRARY(tokenmill_step, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>,
                       at::Tensor, int64_t, int64_t, int64_t, double, double>())
      .def("set_moe", &DecodeStack::set_moe)
      .def("run", &DecodeStack::run);
  m.class_<GemmaDecodeStack>("GemmaDecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>, std::vector<int64_t>, int64_t,
                       int64_t, int64_t, double, double, double>())
      .def("run", &GemmaDecodeStack::run);
}
