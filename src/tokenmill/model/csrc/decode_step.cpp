// A whole decode step's layer stack in one call and one OpenMP parallel region, for the fast path.
//
// Why: batch-1 decode runs ~8 ops a layer (240 a token), each a Python call, a dispatcher trip and,
// for the linears, a fork and join of the thread team; the 121 small matrix-vector products read
// their weights at ~21 GB/s where one large call reaches ~45 (docs/benchmarks.md). llama.cpp keeps one
// thread team for the whole graph and separates its ops by barriers; this does the same: the team is
// forked once per step, and the phases of each layer are separated by barriers (step_barrier.h), a
// microsecond each while the threads spin (GOMP_SPINCOUNT covers the gaps inside a step).
//
// The phases are decode_phases.h's, shared with the gemma family (decode_step_gemma.h), and run the
// kernels of one kit (decode_kits.h: AVX512-VNNI, or AVX2 on CPUs without AVX-512); this file is the
// llama family's sequence of them: norm, qkv, RoPE + K/V store, attention, o, the residual add +
// RMSNorm (fused_ops.h), then SiLU-gated MLP or routed experts (decode_step_moe.h), residual + norm.
// The arithmetic is the unfused fast path's, from the same kernels, in the same order.
//
// Layer weights are bound once (DecodeStack, a TorchScript class held by model/fused_decode.py); a
// step passes only what changes: the residual stream, cos/sin, slots, block table and lengths.

#include "fused_ops.h"
#include "paged_attention.h"
#include "quant_amx.h"
#include "quant_amx8.h"
#include "quant_avx2.h"
#include "quant_bf16_vec.h"
#include "quant_vnni.h"
#include "decode_phases.h"
#include "decode_row_phases.h"
#include "decode_step_moe.h"

#include <omp.h>

#include <torch/custom_class.h>

namespace {

using tm_step::kTerms;
using tm_step::Linear;
using tm_step::Worker;

constexpr int64_t kNormsPerLayer = 2;   // then the parts of qkv, o, gate_up, down (decode_phases.h)

struct Layer {
  const float* input_norm;
  const float* post_norm;
  Linear qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
  int64_t moe = -1;  // index into DecodeStack::moe_blocks where the layer's MLP is routed experts
};

struct DecodeStack : tm_step::StackBase {
  std::vector<Layer> layers;
  std::vector<tm_moe::Block> moe_blocks;
  // Cascade attention (cascade_attention.h) from this many rows sharing this many prefix tokens, and
  // its buffers (one step at a time runs on a stack).
  int64_t cascade_min_rows = 16, cascade_min_prefix = 256;
#if TM_AMX_COMPILES
  tm_cascade::Work cascade_work;
#endif

  DecodeStack(int64_t kit_id, std::vector<at::Tensor> tensors, std::vector<int64_t> formats, std::vector<int64_t> parts,
              std::vector<at::Tensor> k_caches,
              std::vector<at::Tensor> v_caches, at::Tensor final_norm_in, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, double rms_eps, double attn_scale) {
    const int64_t L = static_cast<int64_t>(k_caches.size());
    int64_t total_parts = 0;
    for (const int64_t n : parts) {
      TORCH_CHECK(n >= 0, "a linear has no negative number of weights");
      total_parts += n;
    }
    TORCH_CHECK(L > 0 && static_cast<int64_t>(parts.size()) == 4 * L && static_cast<int64_t>(v_caches.size()) == L &&
                    static_cast<int64_t>(formats.size()) == total_parts &&
                    static_cast<int64_t>(tensors.size()) ==
                        L * kNormsPerLayer + total_parts * tm_step::kTensorsPerPart,
                "expected per layer 2 norms, 4 linears of 4 tensors and a format per part, a K and V cache");
    bind(kit_id, tensors, final_norm_in, k_caches[0], num_heads, num_kv_heads, head_dim, rms_eps, attn_scale);
    const int64_t qkv_n = (nq + 2 * nkv) * hd;
    const at::Tensor* t = tensors.data();
    const int64_t* f = formats.data();
    const int64_t* np = parts.data();
    for (int64_t i = 0; i < L; ++i) {
      for (int j = 0; j < 2; ++j)
        TORCH_CHECK(t[j].is_contiguous() && t[j].scalar_type() == at::kFloat && t[j].numel() == hidden,
                    "layer ", i, ": norm weights must be contiguous float32 [hidden]");
      bind_caches(k_caches[i], v_caches[i], k_caches[0], i);
      const at::Tensor* norms = t;
      t += kNormsPerLayer;
      Linear qkv_l = tm_step::read_linear(t, f, np, hidden, i), o_l = tm_step::read_linear(t, f, np, nq * hd, i);
      Linear gate_up_l = tm_step::read_linear(t, f, np, hidden, i);
      if (inter == 0) inter = gate_up_l.N / 2;
      Linear down_l = tm_step::read_linear(t, f, np, inter, i);
      // A layer without gate_up and down has routed experts, bound by set_moe.
      const bool dense = gate_up_l.N == 2 * inter && down_l.N == hidden;
      TORCH_CHECK(qkv_l.N == qkv_n && o_l.N == hidden && (dense || (gate_up_l.N == 0 && down_l.N == 0)),
                  "layer ", i, ": linear sizes do not match the heads, hidden and intermediate sizes");
      Layer layer{norms[0].data_ptr<float>(), norms[1].data_ptr<float>(), std::move(qkv_l), std::move(o_l),
                  std::move(gate_up_l), std::move(down_l), k_caches[i].data_ptr(), v_caches[i].data_ptr()};
      layers.push_back(std::move(layer));
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
                    static_cast<int64_t>(tensors.size()) == weights * tm_step::kTensorsPerPart,
                "expected gate_up and down (4 tensors, a format each) per expert and shared expert");
    auto weight = [&](int64_t j, int64_t K, int64_t& N) {
      const at::Tensor* t = tensors.data() + j * tm_step::kTensorsPerPart;
      const int bits = tm_vnni::fmt_bits(static_cast<int>(formats[j]));
      TORCH_CHECK(bits > 0, "unknown weight format ", formats[j]);
      N = t[0].numel() * 8 / (K * bits);
      return tm_vnni::check_shapes(t[0], t[1], t[2], t[3], formats[j], N, K);
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
    return tm_step::with_kit(kit, [&]<class Kit>() {
      return run_with<Kit>(x, cos_in, sin_in, slots_in, table_in, lens_in, page_size);
    });
  }

  template <class Kit>
  at::Tensor run_with(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in,
                      const at::Tensor& slots_in, const at::Tensor& table_in, const at::Tensor& lens_in,
                      int64_t page_size) {
    check_step(x, page_size);
    const int64_t T = x.size(0);
    const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
    TORCH_CHECK(cos.numel() == T * hd && sin.numel() == T * hd && cos.scalar_type() == at::kFloat,
                "cos and sin must be float32 [T, head_dim]");
    const at::Tensor slots = slots_in.to(at::kLong).contiguous();
    const at::Tensor table = table_in.to(at::kLong).contiguous();
    const at::Tensor lens = lens_in.to(at::kLong).contiguous();
    TORCH_CHECK(slots.numel() == T && lens.numel() == T && table.dim() == 2 && table.size(0) == T,
                "one slot, length and block-table row per row");
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " is outside the cache");
    const int nt = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
    const tm_attention::Isa isa = Kit::isa();
    // Checks every page id and length: nothing inside the parallel region can fail.
    const tm_attention::Plan plan = tm_attention::make_plan(table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), T,
                                                            table.size(1), page_size, num_slots / page_size, nq,
                                                            nkv, hd, isa, nt);
    at::Tensor out = at::empty({T, hidden}, x.options());
    if (T == 0) return out;
    const tm_cascade::Plan cascade = cascade_plan<Kit>(plan, table, lens, T, page_size);
    for (const Layer& l : layers) TORCH_CHECK(l.gate_up.N > 0 || l.moe >= 0, "a layer has no MLP");
    tm_moe::Scratch moe_scratch;
    if (!moe_blocks.empty()) tm_moe::reserve(moe_scratch, moe_blocks, T, hidden, kTerms);
    tm_step::Scratch s = tm_step::make_scratch(*this, T, plan.partial_size, true, x.options(), Kit::kAmxTiles,
                                                        !moe_blocks.empty());
    float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* snp = sin.data_ptr<float>();
    const int64_t row_elems = tm_kv::row_width(cache_format, hd);
    tm_attention::Args args =
        tm_attention::make_args(plan, s.q, s.attn, s.partial, table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                table.size(1), page_size, nq, nkv, hd, static_cast<float>(scale),
                                num_slots * row_elems, row_elems);
#if TM_AMX_COMPILES
    tm_cascade::Work* cw = nullptr;
    if (cascade.on()) {
      cw = &cascade_work;
      cw->prepare(cascade, T, nq, nkv, hd, cache_format, page_size, static_cast<int64_t>(layers.size()), nt);
      args.starts = cascade.starts.data();
      args.stats = cw->own_stats.data();
    }
#endif
    const tm_attention::RangeFn attend = Kit::attention(cache_format);
    const float e = static_cast<float>(eps);
    const int64_t L = static_cast<int64_t>(layers.size());
    tm_step::StepLogs logs(barrier, nt);

    const bool row_mode = tm_step::one_row(T, plan);
    const at::Tensor copies = at::empty({row_mode ? nt * tm_step::row_copy_floats(*this) : 0}, x.options());

#pragma omp parallel num_threads(nt)
    {
      Worker w(T, plan.scores_size, nq / nkv * hd, barrier, logs.logs);
      if (row_mode) {
        tm_step::RowCopy r = tm_step::make_row_copy(*this, copies.data_ptr<float>(), w.tid, xp, T);
        run_row<Kit>(r, s, moe_scratch, args, attend, cp, snp, sp[0], plan, xp, op, w);
      } else {
        Kit::add_rms_norm(xp, s.zero, layers[0].input_norm, hidden, e, s.h, w.r0, w.r1);
        tm_step::quantize_phase<Kit>(s.h, hidden, s.a_hidden, w);
        for (int64_t i = 0; i < L; ++i) {
          const Layer& l = layers[i];
          tm_step::linear_phase<Kit>(l.qkv, s.a_hidden, T, s.qkv, w);
          tm_step::rope_store_phase<Kit>(*this, s, cp, snp, sp, l.k_cache, l.v_cache, w);
          tm_attention::Args la = args;
          la.k = l.k_cache;
          la.v = l.v_cache;
#if TM_AMX_COMPILES
          if (cw)
            tm_step::cascade_attention_phase<Kit>(*this, s, la, attend, plan, cascade, *cw, cache_format, i, w);
          else
#endif
            tm_step::attention_phase<Kit>(*this, s, la, attend, plan, w);
          tm_step::linear_phase<Kit>(l.o, s.a_attn, T, s.delta, w);
          Kit::add_rms_norm(xp, s.delta, l.post_norm, hidden, e, s.h, w.r0, w.r1);
          tm_step::quantize_phase<Kit>(s.h, hidden, s.a_hidden, w);
          if (l.moe < 0) {
            tm_step::mlp_phase<Kit>(*this, s, l.gate_up, l.down, T, w, Kit::silu_mul);
          } else {
            tm_moe::ffn<Kit>(moe_blocks[l.moe], moe_scratch, s.h, s.a_hidden, hidden, s.delta, w.tid, w.team);
            w.sync();
          }
          const bool last = i + 1 == L;
          Kit::add_rms_norm(xp, s.delta, last ? final_norm : layers[i + 1].input_norm, hidden, e, last ? op : s.h,
                            w.r0, w.r1);
          tm_step::quantize_phase<Kit>(s.h, hidden, s.a_hidden, w, !last);
        }
      }
    }
    logs.finish(barrier);
    return out;
  }

  // Which rows share a prefix to attend once on the tiles (none where the kit has no tiles or the step
  // is one row; tm_cascade::plan says the rest).
  template <class Kit>
  tm_cascade::Plan cascade_plan(const tm_attention::Plan& plan, const at::Tensor& table, const at::Tensor& lens,
                                int64_t T, int64_t page_size) const {
    if (!Kit::kAmxTiles || tm_step::one_row(T, plan)) return {};
    return tm_cascade::plan(plan, table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), T, table.size(1), page_size,
                            cache_format, hd, cascade_min_rows, cascade_min_prefix);
  }

  // From how many rows sharing how many prefix tokens a step attends the prefix once on the tiles
  // (min_rows <= 0: never).
  void set_cascade(int64_t min_rows, int64_t min_prefix) {
    TORCH_CHECK(min_prefix >= 0, "the cascade's prefix must be >= 0 tokens");
    cascade_min_rows = min_rows, cascade_min_prefix = min_prefix;
  }

  // The layers of a one-row step with every thread holding the row (decode_row_phases.h): 5
  // barriers a layer (qkv, attention, o, gate_up, down; a MoE block's 2 for the last two).
  template <class Kit>
  void run_row(tm_step::RowCopy& r, tm_step::Scratch& s, tm_moe::Scratch& moe_scratch, const tm_attention::Args& args,
               tm_attention::RangeFn attend, const float* cos, const float* sin, int64_t slot,
               const tm_attention::Plan& plan, float* x, float* out, Worker& w) {
    const float e = static_cast<float>(eps);
    Kit::add_rms_norm(r.x, s.zero, layers[0].input_norm, hidden, e, r.h, 0, r.rows);
    Kit::quantize_rows(r.h, hidden, 0, r.rows, r.a_hidden);
    const int64_t L = static_cast<int64_t>(layers.size());
    const std::vector<int> owners = tm_step::kv_owners(*this, layers[0].qkv, w.team);  // every layer's split
    const int* early = owners.empty() ? nullptr : owners.data();
    const auto no_norm = [](float*) {};
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers[i];
      tm_step::row_qkv_phase<Kit>(*this, s, r, l.qkv, early, cos, sin, slot, l.k_cache, l.v_cache, w, no_norm);
      tm_attention::Args la = args;
      la.k = l.k_cache;
      la.v = l.v_cache;
      tm_step::row_attention_phase<Kit>(*this, s, r, s.qkv, cos, sin, slot, la, attend, plan, early != nullptr, w);
      tm_step::linear_phase<Kit>(l.o, r.a_attn, r.rows, s.delta, w);
      Kit::add_rms_norm(r.x, s.delta, l.post_norm, hidden, e, r.h, 0, r.rows);
      Kit::quantize_rows(r.h, hidden, 0, r.rows, r.a_hidden);
      if (l.moe < 0) {
        tm_step::row_mlp_phase<Kit>(*this, s, r, l.gate_up, l.down, w, Kit::silu_mul);
      } else {
        tm_moe::ffn<Kit>(moe_blocks[l.moe], moe_scratch, r.h, r.a_hidden, hidden, s.delta, w.tid, w.team);
        w.sync();
      }
      const bool last = i + 1 == L;
      Kit::add_rms_norm(r.x, s.delta, last ? final_norm : layers[i + 1].input_norm, hidden, e, r.h, 0, r.rows);
      if (!last) Kit::quantize_rows(r.h, hidden, 0, r.rows, r.a_hidden);
    }
    tm_step::row_output(*this, r, x, out, w);
  }
};

}  // namespace

#include "decode_step_gemma.h"  // the gemma family's stack

namespace {

// The barrier setting and its totals (decode_phases.h, StackBase), on either family's stack.
template <class Stack>
torch::class_<Stack>& with_barrier(torch::class_<Stack>& c) {
  return c
      .def("set_barrier", [](const c10::intrusive_ptr<Stack>& self, int64_t kind, int64_t spin_us,
                             bool log) { self->set_barrier(kind, spin_us, log); })
      .def("barrier_stats", [](const c10::intrusive_ptr<Stack>& self) { return self->barrier_stats(); });
}

}  // namespace

TORCH_LIBRARY(tokenmill_step, m) {
  auto llama = m.class_<DecodeStack>("DecodeStack");
  llama.def(torch::init<int64_t, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<at::Tensor>,
                       std::vector<at::Tensor>,
                       at::Tensor, int64_t, int64_t, int64_t, double, double>())
      .def("set_moe", &DecodeStack::set_moe)
      .def("set_cascade", &DecodeStack::set_cascade)
      .def("run", &DecodeStack::run);
  with_barrier(llama);
  auto gemma = m.class_<GemmaDecodeStack>("GemmaDecodeStack");
  gemma.def(torch::init<int64_t, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<at::Tensor>,
                       std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>, std::vector<int64_t>, int64_t,
                       int64_t, int64_t, double, double, double>())
      .def("run", &GemmaDecodeStack::run);
  with_barrier(gemma);
}
