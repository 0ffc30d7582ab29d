#pragma once
// The fused decode step of the gemma family (Gemma 2 and 3): decode_step.cpp's one-call layer stack
// with gemma's layer structure, for the same reason (one thread team per step, barriers between the
// phases, no per-op Python or dispatch). Included by decode_step.cpp after its Part / Linear /
// linear_share, which it reuses; model/fused_decode_gemma.py binds it.
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

constexpr int64_t kGemmaNorms = 6;  // input, post-attention, pre-MLP, post-MLP, q (per head), k (per head)

// GELU, tanh form: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh from exp_nonpos of -2|u|.
__attribute__((target("arch=x86-64-v4,prefer-vector-width=512"))) void gelu_tanh_mul_rows(
    const float* gu, int64_t inter, float* out, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* g = gu + t * 2 * inter;
    const float* u = g + inter;
    float* o = out + t * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float x = g[i];
      const float v = 0.7978845608028654f * (x + 0.044715f * x * x * x);
      const float e = tm_math::exp_nonpos(v > 0.f ? -2.f * v : 2.f * v);
      const float th = (1.f - e) / (1.f + e);
      o[i] = 0.5f * x * (1.f + (v > 0.f ? th : -th)) * u[i];
    }
  }
}

// RMSNorm of n-value vectors in place, `count` of them from x on, `stride` apart.
__attribute__((target("arch=x86-64-v4,prefer-vector-width=512"))) void rms_norm_inplace(
    float* x, int64_t count, int64_t stride, int64_t n, const float* w, float eps) {
  for (int64_t c = 0; c < count; ++c) {
    float* v = x + c * stride;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) v[i] = w[i] * (v[i] * inv);
  }
}

// Rows t0..t1: x += norm(delta) * w_delta, then out = norm(x) * w_out (gemma's post-norm residual
// add and the next norm in one pass over each row).
__attribute__((target("arch=x86-64-v4,prefer-vector-width=512"))) void add_normed_rows(
    float* x, float* delta, const float* w_delta, const float* w_out, int64_t hidden, float eps, float* out,
    int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    rms_norm_inplace(delta + t * hidden, 1, hidden, hidden, w_delta, eps);
    float* xr = x + t * hidden;
    const float* dr = delta + t * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) xr[i] += dr[i];
    std::memcpy(out + t * hidden, xr, static_cast<size_t>(hidden) * sizeof(float));
    rms_norm_inplace(out + t * hidden, 1, hidden, hidden, w_out, eps);
  }
}

// The parts of the next linear of K inputs from `t` / `f` / `np` on (decode_step.cpp's order: codes,
// scales, mins, subs and a format per part), advancing them.
inline Linear read_linear(const at::Tensor*& t, const int64_t*& f, const int64_t*& np, int64_t K, int64_t layer) {
  Linear l{{}, 0};
  for (int64_t j = 0; j < *np; ++j, t += kTensorsPerPart, ++f) {
    const int bits = tm_vnni::fmt_bits(static_cast<int>(*f));
    TORCH_CHECK(bits > 0, "layer ", layer, ": unknown weight format ", *f);
    const int64_t N = t[0].numel() * 8 / (K * bits);
    l.parts.push_back(Part{tm_vnni::check(t[0], t[1], t[2], t[3], *f, N, K), N, l.N});
    l.N += N;
  }
  ++np;
  return l;
}

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

struct GemmaDecodeStack : torch::CustomClassHolder {
  std::vector<at::Tensor> keep;
  std::vector<GemmaLayer> layers;
  const float* final_norm = nullptr;
  int64_t hidden = 0, inter = 0, nq = 0, nkv = 0, hd = 0, num_slots = 0;
  double eps = 0, scale = 0, softcap = 0;
  tm_kv::CacheFormat cache_format = tm_kv::kCacheF32;

  GemmaDecodeStack(std::vector<at::Tensor> tensors, std::vector<int64_t> formats, std::vector<int64_t> parts,
                   std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, at::Tensor final_norm_in,
                   std::vector<int64_t> windows, std::vector<int64_t> ropes, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, double rms_eps, double attn_scale, double attn_softcap) {
    TORCH_CHECK(tm_fused::use_avx512() && tm_vnni::vnni_supported(), "the fused decode step needs AVX512-VNNI");
    const int64_t L = static_cast<int64_t>(k_caches.size());
    int64_t total_parts = 0;
    for (const int64_t n : parts) {
      TORCH_CHECK(n > 0, "every linear needs a weight");
      total_parts += n;
    }
    TORCH_CHECK(L > 0 && static_cast<int64_t>(parts.size()) == 4 * L && static_cast<int64_t>(v_caches.size()) == L &&
                    static_cast<int64_t>(windows.size()) == L && static_cast<int64_t>(ropes.size()) == L &&
                    static_cast<int64_t>(formats.size()) == total_parts &&
                    static_cast<int64_t>(tensors.size()) == L * kGemmaNorms + total_parts * kTensorsPerPart,
                "expected per layer 6 norms, 4 linears of 4 tensors and a format per part, a K and V cache, "
                "a window and a RoPE index");
    nq = num_heads, nkv = num_kv_heads, hd = head_dim, eps = rms_eps, scale = attn_scale, softcap = attn_softcap;
    TORCH_CHECK(nkv > 0 && nq % nkv == 0 && hd % 2 == 0 && hd <= 256 && softcap >= 0, "unsupported head layout");
    hidden = final_norm_in.numel();
    TORCH_CHECK(final_norm_in.is_contiguous() && final_norm_in.scalar_type() == at::kFloat,
                "norm weights must be contiguous float32");
    keep = tensors;
    keep.push_back(final_norm_in);
    final_norm = final_norm_in.data_ptr<float>();
    const at::Tensor& c0 = k_caches[0];
    cache_format = tm_kv::cache_format(c0.scalar_type());
    num_slots = c0.size(1);
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
      for (const at::Tensor* c : {&k_caches[i], &v_caches[i]})
        TORCH_CHECK(c->is_contiguous() && c->dim() == 3 && c->size(0) == nkv && c->size(1) == num_slots &&
                        c->size(2) == tm_kv::row_width(cache_format, hd) && c->scalar_type() == c0.scalar_type(),
                    "layer ", i, ": caches must be contiguous [num_kv_heads, slots, row] of one format");
      TORCH_CHECK(windows[i] >= 0 && (ropes[i] == 0 || ropes[i] == 1), "layer ", i, ": bad window or RoPE index");
      layer.qkv = read_linear(t, f, np, hidden, i);
      layer.o = read_linear(t, f, np, nq * hd, i);
      layer.gate_up = read_linear(t, f, np, hidden, i);
      if (i == 0) inter = layer.gate_up.N / 2;
      layer.down = read_linear(t, f, np, inter, i);
      TORCH_CHECK(layer.qkv.N == (nq + 2 * nkv) * hd && layer.o.N == hidden && layer.gate_up.N == 2 * inter &&
                      layer.down.N == hidden,
                  "layer ", i, ": linear sizes do not match the heads, hidden and intermediate sizes");
      layer.k_cache = k_caches[i].data_ptr();
      layer.v_cache = v_caches[i].data_ptr();
      layer.window = windows[i];
      layer.rope = ropes[i];
      layers.push_back(std::move(layer));
      keep.push_back(k_caches[i]);
      keep.push_back(v_caches[i]);
    }
  }

  // x [T, hidden] (the scaled embeddings; the residual stream, updated in place); cos/sin: one or two
  // [T, head_dim] tables (global, then sliding layers'); per layer its slots [T] and block table
  // [T, max_pages] (the same tensors for layers of one KV group); lens [T]. Returns the final norm.
  at::Tensor run(at::Tensor x, std::vector<at::Tensor> cos_in, std::vector<at::Tensor> sin_in,
                 std::vector<at::Tensor> slots_in, std::vector<at::Tensor> tables_in, at::Tensor lens_in,
                 int64_t page_size) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == hidden,
                "x must be contiguous float32 [T, hidden]");
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
    TORCH_CHECK(page_size > 0 && num_slots % page_size == 0, "bad page size");
    const at::Tensor lens = lens_in.to(at::kLong).contiguous();
    TORCH_CHECK(lens.numel() == T, "one length per row");
    const int nt = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
    const tm_attention::Isa isa = tm_attention::selected_isa(-1);

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
    const int64_t group = nq / nkv, qkv_n = (nq + 2 * nkv) * hd;

    at::Tensor out = at::empty({T, hidden}, x.options());
    if (T == 0) return out;
    const int64_t max_k = std::max({hidden, inter, nq * hd});
    const int64_t n_h = T * hidden, n_qkv = T * qkv_n, n_q = T * nq * hd, n_k = T * nkv * hd, n_gu = T * 2 * inter,
                  n_act = T * inter, n_acts = tm_vnni::acts_floats(T, max_k, kTerms);
    at::Tensor buffer = at::empty({2 * n_h + n_qkv + 2 * n_q + n_k + n_gu + n_act + n_acts + partial_size + 16},
                                  x.options());
    float* h = buffer.data_ptr<float>();  // normed input of the next linear
    float* delta = h + n_h;  // o_proj's, then down's output
    float* qkv = delta + n_h;
    float* q = qkv + n_qkv;
    float* attn = q + n_q;
    float* k = attn + n_q;
    float* gu = k + n_k;
    float* act = gu + n_gu;
    float* partial = act + n_act;
    float* acts_base = partial + partial_size;

    float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const tm_vnni::Acts a_hidden = tm_vnni::make_acts(acts_base, T, hidden, kTerms);
    const tm_vnni::Acts a_attn = tm_vnni::make_acts(acts_base, T, nq * hd, kTerms);
    const tm_vnni::Acts a_inter = tm_vnni::make_acts(acts_base, T, inter, kTerms);
    const int64_t row_elems = tm_kv::row_width(cache_format, hd);
    const tm_attention::RangeFn attend = tm_attention::avx512_fns[cache_format];
    const float e = static_cast<float>(eps);
    const int64_t rope_tables = static_cast<int64_t>(cos.size());

#pragma omp parallel num_threads(nt)
    {
      const int tid = omp_get_thread_num(), team = omp_get_num_threads();
      std::vector<float> scores(static_cast<size_t>(scores_size));
      std::vector<float> acc(static_cast<size_t>(group * hd));
      int64_t r0, r1;  // this thread's rows
      share(T, tid, team, r0, r1);
      for (int64_t t = r0; t < r1; ++t) std::memcpy(h + t * hidden, xp + t * hidden, hidden * sizeof(float));
      rms_norm_inplace(h + r0 * hidden, r1 - r0, hidden, hidden, layers[0].norms[0], e);
      tm_vnni::quantize_rows<kTerms>(h, hidden, r0, r1, a_hidden);
#pragma omp barrier
      for (int64_t i = 0; i < L; ++i) {
        const GemmaLayer& l = layers[i];
        linear_share(l.qkv, a_hidden, T, qkv, tid, team);
#pragma omp barrier
        if (l.q_norm != nullptr) {
          for (int64_t t = r0; t < r1; ++t) {
            rms_norm_inplace(qkv + t * qkv_n, nq, hd, hd, l.q_norm, e);
            rms_norm_inplace(qkv + t * qkv_n + nq * hd, nkv, hd, hd, l.k_norm, e);
          }
        }
        const int64_t rp = std::min(l.rope, rope_tables - 1);
        tm_fused::rope_rows_avx512(qkv, qkv_n, cos[rp].data_ptr<float>(), sin[rp].data_ptr<float>(), nq, nkv, hd, q,
                                   k, r0, r1);
        const int64_t* sp = layer_slots[i];
        for (int64_t t = r0; t < r1; ++t) {
          for (int64_t j = 0; j < nkv; ++j) {
            const int64_t row = j * num_slots + sp[t];
            tm_fused::store_cache_row(true, cache_format, k + (t * nkv + j) * hd, l.k_cache, row, hd);
            tm_fused::store_cache_row(true, cache_format, qkv + t * qkv_n + (nq + nkv + j) * hd, l.v_cache, row, hd);
          }
        }
#pragma omp barrier
        {
          const tm_attention::Plan& plan = *layer_plans[i];
          tm_attention::Args la = tm_attention::make_args(plan, q, attn, partial, layer_tables[i], lens.data_ptr<int64_t>(),
                                                          max_pages[i], page_size, nq, nkv, hd,
                                                          static_cast<float>(scale), num_slots * row_elems, row_elems);
          la.k = l.k_cache;
          la.v = l.v_cache;
          la.window = l.window;
          la.softcap = static_cast<float>(softcap);
          const int64_t num_items = plan.num_items(), chunk = (num_items + team - 1) / team;
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
        add_normed_rows(xp, delta, l.norms[1], l.norms[2], hidden, e, h, r0, r1);
        tm_vnni::quantize_rows<kTerms>(h, hidden, r0, r1, a_hidden);
#pragma omp barrier
        linear_share(l.gate_up, a_hidden, T, gu, tid, team);
#pragma omp barrier
        gelu_tanh_mul_rows(gu, inter, act, r0, r1);
        tm_vnni::quantize_rows<kTerms>(act, inter, r0, r1, a_inter);
#pragma omp barrier
        linear_share(l.down, a_inter, T, delta, tid, team);
#pragma omp barrier
        const bool last = i + 1 == L;
        add_normed_rows(xp, delta, l.norms[3], last ? final_norm : layers[i + 1].norms[0], hidden, e, last ? op : h,
                        r0, r1);
        if (!last) tm_vnni::quantize_rows<kTerms>(h, hidden, r0, r1, a_hidden);
#pragma omp barrier
      }
    }
    return out;
  }
};

}  // namespace
