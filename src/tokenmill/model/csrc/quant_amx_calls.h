#pragma once
// The op-by-op entry points of the AMX-BF16 tiles (quant_amx.h): a step's rows split once into what
// its weights' tiles read, then the weights' column blocks shared between the threads.
//
// Why a file of its own: the tiles (quant_amx.h) are what the fused decode step's kits call too
// (decode_kits.h, with a split of their own); this is only the ops' way in (quant_vnni.cpp, and
// quant_multiply.h's choice of kernel).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "quant_amx.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace tm_amx {

#if TM_AMX_COMPILES
// What w's tiles read of the split activations (two_terms: both terms whatever kTerms says; units of
// 16 inputs, tile_block, always multiply both).
inline SplitNeeds needs_of(const Weights& w, bool two_terms) {
  SplitNeeds needs{two_terms, false};
  tm_vnni::with_decoder(w.fmt, [&]<class D>() {
    needs.lo = needs.lo || kTerms<D> == 2 || kUnitInputs<D> != kGroup;
    needs.sums = D::has_min(w);
  });
  return needs;
}

#else
inline SplitNeeds needs_of(const Weights&, bool) { return {}; }
#endif  // TM_AMX_COMPILES

// What any of the weights' tiles read (the parts of a fused linear share one split).
inline SplitNeeds needs_of(const std::vector<Weights>& w, bool two_terms) {
  SplitNeeds needs{false, false};
  for (const Weights& wi : w) {
    const SplitNeeds n = needs_of(wi, two_terms);
    needs = {needs.lo || n.lo, needs.sums || n.sums};
  }
  return needs;
}

// x's rows (contiguous) as the tiles take them (what `needs` says), in `scratch` (the caller's, alive
// while they are read). A bfloat16 x is its own hi, read in place where its rows fill whole tiles
// (else copied with the padding rows zero); where lo or the sums are needed too, its float32 values
// are split.
inline SplitActs split_rows(const at::Tensor& x, at::Tensor& scratch, SplitNeeds needs) {
  TORCH_CHECK(x.is_contiguous(), "AMX tiles: x must have contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16 && (needs.lo || needs.sums)) return split_rows(x.to(at::kFloat), scratch, needs);
  if (x.scalar_type() == at::kBFloat16) {
    SplitActs a{nullptr, nullptr, nullptr, nullptr, padded_rows(M), K};
    if (a.Mp == M) {
      a.hi = reinterpret_cast<uint16_t*>(x.data_ptr());
      return a;
    }
    scratch = at::zeros({a.Mp, K}, x.options());
    scratch.narrow(0, 0, M).copy_(x);
    a.hi = reinterpret_cast<uint16_t*>(scratch.data_ptr());
    return a;
  }
  scratch = at::empty({split_floats(M, K, needs)}, x.options());
  const SplitActs a = make_split(scratch.data_ptr<float>(), M, K, needs);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, a.Mp, kTileRows, [&](int64_t m0, int64_t m1) { split_into(xp, m0, m1, M, a); });
  return a;
}

// y [M, N] = x @ W^T for weights side by side (quant_vnni.cpp `multiply`'s parts), on AMX tiles
// (two_terms: see kTerms).
inline at::Tensor multiply(const at::Tensor& x, const std::vector<Weights>& w, const std::vector<int64_t>& block0,
                           bool two_terms = false) {
  const int64_t M = x.size(0), nblocks = block0.back(), N = nblocks * kCols;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  at::Tensor scratch;
  const SplitActs a = split_rows(x, scratch, needs_of(w, two_terms));
  float* yp = y.data_ptr<float>();
  // Threads take column blocks (every thread reads all rows' activations from L2 / L3, which a
  // 512-row step of K = 1536 holds in 3 MB; each decodes only its own blocks).
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < w.size(); ++i) {
      const int64_t lo = std::max(b0, block0[i]), hi = std::min(b1, block0[i + 1]);
      if (lo < hi) blocks(w[i], a, M, lo - block0[i], hi - block0[i], yp + block0[i] * kCols, N, two_terms);
    }
  });
  return y;
}

// silu(x @ gate^T) * (x @ up^T) [M, N / 2] for a gate and an up projection stacked in w (N rows, the
// gate's first; glu_fuses(w)): the tiles' sums of a gate block and its up block meet in one tile_pair,
// so neither is written out and no pass over them follows. SmolLM2's Q8_0 gate / up and silu_mul at
// 512 rows: 2.22 -> 1.93 ms (docs/benchmarks.md, "silu(gate) * up in the tiles' epilogue").
// A bfloat16 x gives a bfloat16 y (what the down projection's tiles read: rounded as its split would).
inline at::Tensor multiply_silu_mul(const at::Tensor& x, const Weights& w, int64_t N) {
  const int64_t M = x.size(0), half = N / (2 * kCols);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({M, N / 2}, x.options());
  if (M == 0) return y;
  at::Tensor scratch;
  const SplitActs a = split_rows(x, scratch, needs_of(w, false));
  float* yp = static_cast<float*>(y.data_ptr());
  at::parallel_for(0, half, 1, [&](int64_t b0, int64_t b1) { blocks(w, a, M, b0, b1, yp, N / 2, false, half, bf16); });
  return y;
}

}  // namespace tm_amx
