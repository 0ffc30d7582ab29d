#pragma once
// y = x @ W^T on the column-blocked weights for any number of rows: the VNNI kernel (quant_vnni.h),
// AMX-BF16 tiles (quant_amx.h) for two-term steps of many rows where the CPU has them (else, for Q8_0,
// their one-term products on AVX512-BF16: quant_bf16_vec.h), or AMX-INT8 tiles (quant_amx8.h) for
// steps of a few dozen rows of the formats whose sub-block scales fold.
//
// Why a header: the linear ops (quant_vnni.cpp) and the MoE experts op (moe_experts.cpp), which runs
// it for one expert on each thread, call the same function, so both compute the same bits.

#include <ATen/ops/cat.h>

#include "blocked_ops.h"
#include "quant_amx_calls.h"
#include "quant_amx8.h"
#include "quant_bf16_vec.h"
#include "quant_vnni.h"

namespace tm_vnni {
namespace {

// y [M, N] = x @ W^T for weights side by side (one, or the parts of a fused linear: part i's column
// blocks start at block0[i]; block0 ends with N / 16). x float32 [M, K], contiguous (bfloat16: as
// the AMX-BF16 tiles take it, converted for the other kernels).
// amx: steps of two terms and tm_amx::kAmxMinRows+ rows may run AMX-BF16 tiles instead (quant_amx.h),
// and in those of tm_amx8::kAmx8MinRows+ rows the parts of the formats that fold AMX-INT8 tiles
// (quant_amx8.h), where the CPU has them. amx8: those parts on the AMX-INT8 tiles at any rows (up to
// kAmxMinRows + 16; tests and benchmarks). two_tile_terms: the AMX-BF16 tiles multiply both bf16 terms
// of the activations for every format (quant_amx.h kTerms; the lm_head).
at::Tensor multiply(const at::Tensor& x_in, const std::vector<Weights>& w, const std::vector<int64_t>& block0,
                    int64_t terms, bool amx, bool amx8 = false, bool two_tile_terms = false) {
  const int64_t M = x_in.size(0), K = x_in.size(1), nblocks = block0.back(), N = nblocks * kCols;
  if (!amx8 && amx && terms == 2 && M >= tm_amx::kAmxMinRows && tm_amx::amx_ready())
    return tm_amx::multiply(x_in, w, block0, two_tile_terms);
  if (!amx8 && amx && terms == 2 && !two_tile_terms && M >= tm_amx::kVecMinRows && tm_amx::vec_ready()) {
    // No AMX: its one-term products on AVX512-BF16 for the parts that take them (Q8_0), each part as it
    // runs alone (a fused q / k / v of Q8_0 and Q5_0: the parts one by one, side by side)
    if (tm_amx::vec_takes(w)) return tm_amx::multiply_vec(x_in, w, block0);
    if (w.size() > 1 && std::any_of(w.begin(), w.end(), [](const Weights& wi) { return tm_amx::vec_takes(wi); })) {
      std::vector<at::Tensor> ys;
      for (size_t i = 0; i < w.size(); ++i)
        ys.push_back(multiply(x_in, {w[i]}, {0, block0[i + 1] - block0[i]}, terms, amx, amx8, two_tile_terms));
      return at::cat(ys, 1);
    }
  }
  const at::Tensor x = x_in.scalar_type() == at::kFloat ? x_in : x_in.to(at::kFloat);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  // The AMX-INT8 tiles' rows: rounded once for every part that folds.
  tm_amx8::Acts8 a8;
  at::Tensor a8_buf;
#if TM_AMX_COMPILES
  const bool folding = std::any_of(w.begin(), w.end(), [](const Weights& wi) { return tm_amx8::folds(wi.fmt); });
  if (folding && K % tm_amx8::kSuperInputs == 0 && tm_amx8::ready() &&
      (amx8 || (amx && terms == 2 && M >= tm_amx8::kAmx8MinRows))) {
    TORCH_CHECK(M <= tm_amx::kAmxMinRows + tm_amx8::kTileRows, "AMX-INT8 tiles: unsupported shape");
    a8_buf = at::empty({tm_amx8::acts8_floats(M, K) + 16}, x.options());
    a8 = tm_amx8::make_acts8(tm_amx::align64(a8_buf.data_ptr<float>()), M, K);
    tm_amx8::quantize_rows(x.data_ptr<float>(), 0, a8.Mp, a8);
  }
#endif
  // The VNNI kernel's rounding only where a part runs it (not when every part takes the AMX-INT8 tiles).
  const bool vnni_parts = a8.q == nullptr ||
                          !std::all_of(w.begin(), w.end(), [](const Weights& wi) { return tm_amx8::folds(wi.fmt); });
  at::Tensor scratch;
  const Acts a = vnni_parts ? acts_scratch(M, K, terms, x, scratch) : Acts{};
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto round = [&](int64_t m0, int64_t m1) {
    if (terms == 2) quantize_rows<2>(xp, K, m0, m1, a);
    else quantize_rows<1>(xp, K, m0, m1, a);
  };
  // y's column blocks b0..b1 (over all parts, in order) for rows m0..m1, each part into its columns
  auto go = [&](int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
    for (size_t i = 0; i < w.size(); ++i) {
      const int64_t lo = std::max(b0, block0[i]), hi = std::min(b1, block0[i + 1]);
      if (lo >= hi) continue;
      float* yi = yp + block0[i] * kCols;
#if TM_AMX_COMPILES
      if (a8.q != nullptr && tm_amx8::folds(w[i].fmt)) {
        tm_amx8::blocks(w[i], a8, lo - block0[i], hi - block0[i], yi, N);
        continue;
      }
#endif
      if (terms == 2) blocks<2>(w[i], a, m0, m1, N, lo - block0[i], hi - block0[i], yi);
      else blocks<1>(w[i], a, m0, m1, N, lo - block0[i], hi - block0[i], yi);
    }
  };
  if (a8.q == nullptr && M >= kSplitRowsFrom && N * K <= kSplitRowsMaxWeights) {
    // Threads take rows (full tiles each, at least 8 rows), every thread rounding its own rows: the
    // rounding (~13 ns a group and row, 30 us of K = 1536 x 48 rows) is split too, with no second
    // fork or barrier. Each thread reads every weight: little against 16 rows' compute for a layer's
    // matrix, but not for a vocabulary's (28 MB for SmolLM2's lm_head, whose rounding is nothing).
    at::parallel_for(0, M, kMaxRows, [&](int64_t m0, int64_t m1) {
      round(m0, m1);
      go(m0, m1, 0, nblocks);
    });
  } else {
    // Threads take column blocks, at least ~32k weights each (small layers do not pay a fork for
    // nothing); the rows are rounded once, before (the AMX-INT8 tiles take all rows of a block).
    if (vnni_parts) round(0, M);
    const int64_t grain = std::max<int64_t>(1, 32768 / (kCols * K));
    at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) { go(0, M, b0, b1); });
  }
  return y;
}

}  // namespace
}  // namespace tm_vnni
