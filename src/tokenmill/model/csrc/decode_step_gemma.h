#pragma once
// The fused decode step of the gemma family (Gemma 2 and 3): decode_step.cpp's one-call layer stack
// with gemma's layer structure, for the same reason (one thread team per step, barriers between the
// phases, no per-op Python or dispatch), as gemma's sequence of the shared phases (decode_phases.h).
// Included by decode_step.cpp; model/fused_decode_gemma.py binds it.
//
// What differs from the llama layer (model/gemma.py has the why of each):
//   - four norms a layer: h = norm(x) into attention; x += norm(o(attn)); h = norm(x) into the MLP;
//     x += norm(down(mlp)) (each RMSNorm times its weight, which the loader made 1 + w);
//   - Gemma 3's per-head RMSNorm of q and k before RoPE;
//   - GeGLU: gelu_tanh(gate) * up;
//   - two RoPE tables (sliding layers: theta 10,000, global ones: the file's), one per layer;
//   - a sliding window per layer, and Gemma 2's score soft-cap, in the attention kernel;
//   - ONE block table and slot list per layer: a hybrid KV cache gives sliding layers their own
//     group's pages (today the runner hands every layer the same tensors). Plans are made once per
//     distinct (table, window).
// The embeddings' sqrt(hidden) scale, the tied lm_head and the final soft-cap stay in Python.

#include <map>
#include <utility>

namespace {

using tm_step::Linear;
using tm_step::Worker;

constexpr int64_t kGemmaNorms = 6;  // input, post-attention, pre-MLP, post-MLP, q (per head), k (per head)

// Gemma's own row steps, per ISA (the kit's): GeGLU's gelu_tanh(gate) * up; RMSNorm of n-value vectors
// in place (`count` of them from x on, `stride` apart); x += norm(delta) * w_delta then out = norm(x) *
// w_out (gemma's post-norm residual add and the next norm in one pass over each row).
// GELU, tanh form: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh from exp_nonpos of -2|u|.
#define TM_GEMMA_ROWS(SUFFIX, ATTR)                                                                      \
  ATTR void gelu_tanh_mul_rows_##SUFFIX(const float* gu, int64_t inter, float* out, int64_t t0, int64_t t1) { \
    for (int64_t t = t0; t < t1; ++t) {                                                                  \
      const float* g = gu + t * 2 * inter;                                                               \
      const float* u = g + inter;                                                                        \
      float* o = out + t * inter;                                                                        \
      _Pragma("omp simd") for (int64_t i = 0; i < inter; ++i) {                                          \
        const float x = g[i];                                                                            \
        const float v = 0.7978845608028654f * (x + 0.044715f * x * x * x);                               \
        const float e = tm_math::exp_nonpos(v > 0.f ? -2.f * v : 2.f * v);                               \
        const float th = (1.f - e) / (1.f + e);                                                          \
        o[i] = 0.5f * x * (1.f + (v > 0.f ? th : -th)) * u[i];                                           \
      }                                                                                                  \
    }                                                                                                    \
  }                                                                                                      \
  ATTR void rms_norm_inplace_##SUFFIX(float* x, int64_t count, int64_t stride, int64_t n, const float* w,  \
                                      float eps) {                                                       \
    for (int64_t c = 0; c < count; ++c) {                                                                \
      float* v = x + c * stride;                                                                         \
      float ss = 0.f;                                                                                    \
      _Pragma("omp simd reduction(+ : ss)") for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];           \
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);                               \
      _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) v[i] = w[i] * (v[i] * inv);                    \
    }                                                                                                    \
  }                                                                                                      \
  ATTR void add_normed_rows_##SUFFIX(float* x, float* delta, const float* w_delta, const float* w_out,     \
                                     int64_t hidden, float eps, float* out, int64_t t0, int64_t t1) {    \
    for (int64_t t = t0; t < t1; ++t) {                                                                  \
      rms_norm_inplace_##SUFFIX(delta + t * hidden, 1, hidden, hidden, w_delta, eps);                    \
      float* xr = x + t * hidden;                                                                        \
      const float* dr = delta + t * hidden;                                                              \
      _Pragma("omp simd") for (int64_t i = 0; i < hidden; ++i) xr[i] += dr[i];                           \
      std::memcpy(out + t * hidden, xr, static_cast<size_t>(hidden) * sizeof(float));                    \
      rms_norm_inplace_##SUFFIX(out + t * hidden, 1, hidden, hidden, w_out, eps);                        \
    }                                                                                                    \
  }

TM_GEMMA_ROWS(avx512, __attribute__((target("arch=x86-64-v4,prefer-vector-width=512"))))
TM_GEMMA_ROWS(avx2, __attribute__((target("arch=x86-64-v3"))))

// The variant of the kit's ISA.
template <class Kit>
struct GemmaRows {
  static constexpr auto gelu_tanh_mul = gelu_tanh_mul_rows_avx512;
  static constexpr auto rms_norm_inplace = rms_norm_inplace_avx512;
  static constexpr auto add_normed_rows = add_normed_rows_avx512;
};

template <>
struct GemmaRows<tm_step::Avx2Kit> {
  static constexpr auto gelu_tanh_mul = gelu_tanh_mul_rows_avx2;
  static constexpr auto rms_norm_inplace = rms_norm_inplace_avx2;
  static constexpr auto add_normed_rows = add_normed_rows_avx2;
};

struct GemmaLayer {
  const float* norms[4];  // input, post-attention, pre-MLP, post-MLP
  const float* q_norm;  // nullptr: none (Gemma 2)
  const float* k_norm;
  Linear qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
  int64_t window;  // 0: full attention
  int64_t rope;  // which cos/sin pair
};

struct GemmaDecodeStack : tm_step::StackBase {
  std::vector<GemmaLayer> layers;
  double softcap = 0;

  GemmaDecodeStack(int64_t kit_id, std::vector<at::Tensor> tensors, std::vector<int64_t> formats,
                   std::vector<int64_t> parts, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                   at::Tensor final_norm_in,
                   std::vector<int64_t> windows, std::vector<int64_t> ropes, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, double rms_eps, double attn_scale, double attn_softcap) {
    const int64_t L = static_cast<int64_t>(k_caches.size());
    int64_t total_parts = 0;
    for (const int64_t n : parts) {
      TORCH_CHECK(n > 0, "every linear needs a weight");
      total_parts += n;
    }
    TORCH_CHECK(L > 0 && static_cast<int64_t>(parts.size()) == 4 * L && static_cast<int64_t>(v_caches.size()) == L &&
                    static_cast<int64_t>(windows.size()) == L && static_cast<int64_t>(ropes.size()) == L &&
                    static_cast<int64_t>(formats.size()) == total_parts &&
                    static_cast<int64_t>(tensors.size()) == L * kGemmaNorms + total_parts * tm_step::kTensorsPerPart,
                "expected per layer 6 norms, 4 linears of 4 tensors and a format per part, a K and V cache, "
                "a window and a RoPE index");
    TORCH_CHECK(attn_softcap >= 0, "the attention soft-cap must be >= 0");
    softcap = attn_softcap;
    bind(kit_id, tensors, final_norm_in, k_caches[0], num_heads, num_kv_heads, head_dim, rms_eps, attn_scale);
    const at::Tensor* t = tensors.data();
    const int64_t* f = formats.data();
    const int64_t* np = parts.data();
    for (int64_t i = 0; i < L; ++i) {
      GemmaLayer layer{};
      for (int j = 0; j < kGemmaNorms; ++j) {
        const int64_t n = j < 4 ? hidden : hd;
        const bool optional = j >= 4;
        TORCH_CHECK((optional && t[j].numel() == 0) ||
                        (t[j].is_contiguous() && t[j].scalar_type() == at::kFloat && t[j].numel() == n),
                    "layer ", i, ": norm weights must be contiguous float32 [hidden] (q/k: [head_dim] or empty)");
        const float* w = t[j].numel() ? t[j].data_ptr<float>() : nullptr;
        if (j < 4) layer.norms[j] = w;
        else (j == 4 ? layer.q_norm : layer.k_norm) = w;
      }
      TORCH_CHECK((layer.q_norm == nullptr) == (layer.k_norm == nullptr), "layer ", i, ": q and k norms go together");
      t += kGemmaNorms;
      bind_caches(k_caches[i], v_caches[i], k_caches[0], i);
      TORCH_CHECK(windows[i] >= 0 && (ropes[i] == 0 || ropes[i] == 1), "layer ", i, ": bad window or RoPE index");
      layer.qkv = tm_step::read_linear(t, f, np, hidden, i);
      layer.o = tm_step::read_linear(t, f, np, nq * hd, i);
      layer.gate_up = tm_step::read_linear(t, f, np, hidden, i);
      if (i == 0) inter = layer.gate_up.N / 2;
      layer.down = tm_step::read_linear(t, f, np, inter, i);
      TORCH_CHECK(layer.qkv.N == (nq + 2 * nkv) * hd && layer.o.N == hidden && layer.gate_up.N == 2 * inter &&
                      layer.down.N == hidden,
                  "layer ", i, ": linear sizes do not match the heads, hidden and intermediate sizes");
      layer.k_cache = k_caches[i].data_ptr();
      layer.v_cache = v_caches[i].data_ptr();
      layer.window = windows[i];
      layer.rope = ropes[i];
      layers.push_back(std::move(layer));
    }
  }

  // x [T, hidden] (the scaled embeddings; the residual stream, updated in place); cos/sin: one or two
  // [T, head_dim] tables (global, then sliding layers'); per layer its slots [T] and block table
  // [T, max_pages] (the same tensors for layers of one KV group); lens [T]. Returns the final norm.
  at::Tensor run(at::Tensor x, std::vector<at::Tensor> cos_in, std::vector<at::Tensor> sin_in,
                 std::vector<at::Tensor> slots_in, std::vector<at::Tensor> tables_in, at::Tensor lens_in,
                 int64_t page_size) {
    return tm_step::with_kit(kit, [&]<class Kit>() {
      return run_with<Kit>(x, cos_in, sin_in, slots_in, tables_in, lens_in, page_size);
    });
  }

  template <class Kit>
  at::Tensor run_with(const at::Tensor& x, const std::vector<at::Tensor>& cos_in, const std::vector<at::Tensor>& sin_in,
                      const std::vector<at::Tensor>& slots_in, const std::vector<at::Tensor>& tables_in,
                      const at::Tensor& lens_in, int64_t page_size) {
    using Rows = GemmaRows<Kit>;
    check_step(x, page_size);
    const int64_t T = x.size(0), L = static_cast<int64_t>(layers.size());
    TORCH_CHECK(!cos_in.empty() && cos_in.size() == sin_in.size() && cos_in.size() <= 2, "one or two cos/sin tables");
    TORCH_CHECK(static_cast<int64_t>(slots_in.size()) == L && static_cast<int64_t>(tables_in.size()) == L,
                "one slot list and block table per layer");
    std::vector<at::Tensor> cos, sin;
    for (size_t r = 0; r < cos_in.size(); ++r) {
      cos.push_back(cos_in[r].contiguous());
      sin.push_back(sin_in[r].contiguous());
      TORCH_CHECK(cos[r].numel() == T * hd && sin[r].numel() == T * hd && cos[r].scalar_type() == at::kFloat &&
                      sin[r].scalar_type() == at::kFloat,
                  "cos and sin must be float32 [T, head_dim]");
    }
    const at::Tensor lens = lens_in.to(at::kLong).contiguous();
    TORCH_CHECK(lens.numel() == T, "one length per row");
    const int nt = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
    const tm_attention::Isa isa = Kit::isa();

    // Per layer: its slots, and the plan of its (table, window), each made (and checked) once.
    std::map<const void*, at::Tensor> slot_lists, tables;
    std::map<std::pair<const void*, int64_t>, tm_attention::Plan> plans;
    std::vector<const int64_t*> layer_slots(L), layer_tables(L);
    std::vector<const tm_attention::Plan*> layer_plans(L);
    std::vector<int64_t> max_pages(L);
    int64_t scores_size = 1, partial_size = 0;
    for (int64_t i = 0; i < L; ++i) {
      const void* skey = slots_in[i].unsafeGetTensorImpl();
      if (!slot_lists.count(skey)) {
        at::Tensor s = slots_in[i].to(at::kLong).contiguous();
        TORCH_CHECK(s.numel() == T, "layer ", i, ": one slot per row");
        const int64_t* sp = s.data_ptr<int64_t>();
        for (int64_t r = 0; r < T; ++r) TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, "slot ", sp[r], " is outside the cache");
        slot_lists[skey] = s;
      }
      layer_slots[i] = slot_lists[skey].data_ptr<int64_t>();
      const void* tkey = tables_in[i].unsafeGetTensorImpl();
      if (!tables.count(tkey)) {
        at::Tensor tb = tables_in[i].to(at::kLong).contiguous();
        TORCH_CHECK(tb.dim() == 2 && tb.size(0) == T, "layer ", i, ": one block-table row per row");
        tables[tkey] = tb;
      }
      const at::Tensor& tb = tables[tkey];
      layer_tables[i] = tb.data_ptr<int64_t>();
      max_pages[i] = tb.size(1);
      const auto key = std::make_pair(tkey, layers[i].window);
      if (!plans.count(key))
        plans[key] = tm_attention::make_plan(layer_tables[i], lens.data_ptr<int64_t>(), T, tb.size(1), page_size,
                                             num_slots / page_size, nq, nkv, hd, isa, nt, layers[i].window);
      layer_plans[i] = &plans[key];
      scores_size = std::max(scores_size, layer_plans[i]->scores_size);
      partial_size = std::max(partial_size, layer_plans[i]->partial_size);
    }
    const int64_t qkv_n = (nq + 2 * nkv) * hd;

    at::Tensor out = at::empty({T, hidden}, x.options());
    if (T == 0) return out;
    tm_step::Scratch s = tm_step::make_scratch(*this, T, partial_size, false, x.options(), Kit::kAmxTiles, false);
    float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t row_elems = tm_kv::row_width(cache_format, hd);
    const tm_attention::RangeFn attend = Kit::attention(cache_format);
    const float e = static_cast<float>(eps);
    const int64_t rope_tables = static_cast<int64_t>(cos.size());
    tm_step::StepLogs logs(barrier, nt);

    bool row_mode = T == 1;
    for (const auto& [key, plan] : plans) row_mode = row_mode && tm_step::one_row(T, plan);
    const at::Tensor copies = at::empty({row_mode ? nt * tm_step::row_copy_floats(*this) : 0}, x.options());
    std::vector<tm_attention::Args> layer_args(L);
    for (int64_t i = 0; i < L; ++i) {
      tm_attention::Args& la = layer_args[i];
      la = tm_attention::make_args(*layer_plans[i], s.q, s.attn, s.partial, layer_tables[i], lens.data_ptr<int64_t>(),
                                   max_pages[i], page_size, nq, nkv, hd, static_cast<float>(scale),
                                   num_slots * row_elems, row_elems);
      la.k = layers[i].k_cache;
      la.v = layers[i].v_cache;
      la.window = layers[i].window;
      la.softcap = static_cast<float>(softcap);
    }

#pragma omp parallel num_threads(nt)
    {
      Worker w(T, scores_size, nq / nkv * hd, barrier, logs.logs);
      if (row_mode) {
        tm_step::RowCopy r = tm_step::make_row_copy(*this, copies.data_ptr<float>(), w.tid, xp, T);
        run_row<Kit>(r, s, layer_args, layer_plans, layer_slots, cos, sin, xp, op, w);
      } else {
        for (int64_t t = w.r0; t < w.r1; ++t) std::memcpy(s.h + t * hidden, xp + t * hidden, hidden * sizeof(float));
        Rows::rms_norm_inplace(s.h + w.r0 * hidden, w.r1 - w.r0, hidden, hidden, layers[0].norms[0], e);
        tm_step::quantize_phase<Kit>(s.h, hidden, s.a_hidden, w);
        for (int64_t i = 0; i < L; ++i) {
          const GemmaLayer& l = layers[i];
          tm_step::linear_phase<Kit>(l.qkv, s.a_hidden, T, s.qkv, w);
          if (l.q_norm != nullptr) {
            for (int64_t t = w.r0; t < w.r1; ++t) {
              Rows::rms_norm_inplace(s.qkv + t * qkv_n, nq, hd, hd, l.q_norm, e);
              Rows::rms_norm_inplace(s.qkv + t * qkv_n + nq * hd, nkv, hd, hd, l.k_norm, e);
            }
          }
          const int64_t rp = std::min(l.rope, rope_tables - 1);
          tm_step::rope_store_phase<Kit>(*this, s, cos[rp].data_ptr<float>(), sin[rp].data_ptr<float>(), layer_slots[i],
                                    l.k_cache, l.v_cache, w);
          tm_step::attention_phase<Kit>(*this, s, layer_args[i], attend, *layer_plans[i], w);
          tm_step::linear_phase<Kit>(l.o, s.a_attn, T, s.delta, w);
          Rows::add_normed_rows(xp, s.delta, l.norms[1], l.norms[2], hidden, e, s.h, w.r0, w.r1);
          tm_step::quantize_phase<Kit>(s.h, hidden, s.a_hidden, w);
          tm_step::mlp_phase<Kit>(*this, s, l.gate_up, l.down, T, w, Rows::gelu_tanh_mul);
          const bool last = i + 1 == L;
          Rows::add_normed_rows(xp, s.delta, l.norms[3], last ? final_norm : layers[i + 1].norms[0], hidden, e,
                          last ? op : s.h, w.r0, w.r1);
          tm_step::quantize_phase<Kit>(s.h, hidden, s.a_hidden, w, !last);
        }
      }
    }
    logs.finish(barrier);
    return out;
  }

  // The layers of a one-row step with every thread holding the row (decode_row_phases.h): 5
  // barriers a layer (qkv, attention, o, gate_up, down) instead of 10.
  template <class Kit>
  void run_row(tm_step::RowCopy& r, tm_step::Scratch& s, const std::vector<tm_attention::Args>& layer_args,
               const std::vector<const tm_attention::Plan*>& layer_plans, const std::vector<const int64_t*>& layer_slots,
               const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin, float* x,
               float* out, Worker& w) {
    const float e = static_cast<float>(eps);
    const int64_t L = static_cast<int64_t>(layers.size()), qk_n = (nq + nkv) * hd;
    using Rows = GemmaRows<Kit>;
    const tm_attention::RangeFn attend = Kit::attention(cache_format);
    std::memcpy(r.h, r.x, static_cast<size_t>(hidden) * sizeof(float));
    Rows::rms_norm_inplace(r.h, r.rows, hidden, hidden, layers[0].norms[0], e);
    Kit::quantize_rows(r.h, hidden, 0, r.rows, r.a_hidden);
    // x += norm(delta) and the next norm, from the copy's own copy of the shared delta (normed in place).
    const auto add_delta = [&](const float* w_delta, const float* w_out) {
      std::memcpy(r.delta, s.delta, static_cast<size_t>(hidden) * sizeof(float));
      Rows::add_normed_rows(r.x, r.delta, w_delta, w_out, hidden, e, r.h, 0, r.rows);
    };
    const std::vector<int> owners = tm_step::kv_owners(*this, layers[0].qkv, w.team);  // every layer's split
    const int* early = owners.empty() ? nullptr : owners.data();
    for (int64_t i = 0; i < L; ++i) {
      const GemmaLayer& l = layers[i];
      const int64_t rp = std::min<int64_t>(l.rope, static_cast<int64_t>(cos.size()) - 1);
      const float* c = cos[rp].data_ptr<float>();
      const float* sn = sin[rp].data_ptr<float>();
      const auto norm_k = [&](float* k) {
        if (l.k_norm != nullptr) Rows::rms_norm_inplace(k, r.rows, hd, hd, l.k_norm, e);
      };
      tm_step::row_qkv_phase<Kit>(*this, s, r, l.qkv, early, c, sn, layer_slots[i][0], l.k_cache, l.v_cache, w, norm_k);
      const float* qk = s.qkv;
      if (l.q_norm != nullptr) {
        std::memcpy(r.qk, s.qkv, static_cast<size_t>(early ? nq * hd : qk_n) * sizeof(float));
        Rows::rms_norm_inplace(r.qk, nq, hd, hd, l.q_norm, e);
        if (early == nullptr) Rows::rms_norm_inplace(r.qk + nq * hd, nkv, hd, hd, l.k_norm, e);
        qk = r.qk;
      }
      tm_step::row_attention_phase<Kit>(*this, s, r, qk, c, sn, layer_slots[i][0], layer_args[i], attend,
                                        *layer_plans[i], early != nullptr, w);
      tm_step::linear_phase<Kit>(l.o, r.a_attn, r.rows, s.delta, w);
      add_delta(l.norms[1], l.norms[2]);
      Kit::quantize_rows(r.h, hidden, 0, r.rows, r.a_hidden);
      tm_step::row_mlp_phase<Kit>(*this, s, r, l.gate_up, l.down, w, Rows::gelu_tanh_mul);
      const bool last = i + 1 == L;
      add_delta(l.norms[3], last ? final_norm : layers[i + 1].norms[0]);
      if (!last) Kit::quantize_rows(r.h, hidden, 0, r.rows, r.a_hidden);
    }
    tm_step::row_output(*this, r, x, out, w);
  }
};

}  // namespace
