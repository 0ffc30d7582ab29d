#pragma once
// What the blocked quantized-linear ops of every ISA (quant_vnni.cpp, quant_avx2.cpp) do alike
// around their kernels: the rounded activations' scratch, the parts of a fused linear, row ids.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "blocked_weights.h"
#include "quant_acts.h"

#include <vector>

namespace tm_vnni {
namespace {

// One scratch buffer for M rows of K activations rounded to `terms` int8 terms and their per-group
// numbers (an allocation per array was ~0.2 ms of a 6 ms batch-1 step: 121 calls a token), kept by
// the calling thread up to 1 MB (decode-sized calls: 0.3 us a call less than allocating one);
// larger ones live in `keep` for the call.
inline Acts acts_scratch(int64_t M, int64_t K, int64_t terms, const at::Tensor& like, at::Tensor& keep) {
  const int64_t floats = acts_floats(M, K, terms);
  thread_local std::vector<float> kept;
  float* base;
  if (floats <= (int64_t{1} << 18)) {
    if (static_cast<int64_t>(kept.size()) < floats) kept.resize(floats);
    base = kept.data();
  } else {
    keep = at::empty({floats}, like.options().dtype(at::kFloat));
    base = keep.data_ptr<float>();
  }
  return make_acts(base, M, K, terms);
}

// The parts of a fused linear (four tensors each: codes, scales, mins, subs), checked by `check`,
// and where each part's column blocks start (block0 ends with N / 16).
struct Parts {
  std::vector<Weights> w;
  std::vector<int64_t> block0;
};

template <class Check>
Parts parts_of(at::TensorList weights, at::IntArrayRef fmts, at::IntArrayRef Ns, int64_t K, Check&& check) {
  const size_t P = fmts.size();
  TORCH_CHECK(P > 0 && Ns.size() == P && weights.size() == 4 * P,
              "one format, one N and four tensors (codes, scales, mins, subs) per part");
  Parts parts{std::vector<Weights>(P), std::vector<int64_t>(P + 1, 0)};
  for (size_t i = 0; i < P; ++i) {
    parts.w[i] = check(weights[4 * i], weights[4 * i + 1], weights[4 * i + 2], weights[4 * i + 3], fmts[i], Ns[i], K);
    parts.block0[i + 1] = parts.block0[i] + Ns[i] / kCols;
  }
  return parts;
}

// x float32 [M, K] (or, with bf16_ok, bfloat16: the ops that round it to bf16 anyway take it as it
// is, the others convert it), contiguous, and terms 1 or 2: what every linear op takes.
inline at::Tensor checked_x(const at::Tensor& x, int64_t terms, bool bf16_ok = false) {
  TORCH_CHECK(terms == 1 || terms == 2, "terms must be 1 or 2");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || (bf16_ok && x.scalar_type() == at::kBFloat16)),
              bf16_ok ? "x must be float32 or bfloat16 [M, K]" : "x must be float32 [M, K]");
  return x.contiguous();
}

// Row ids as int64, each checked against N.
inline at::Tensor checked_ids(const at::Tensor& ids_in, int64_t N) {
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "row id ", idp[t], " is outside [0, ", N, ")");
  return ids;
}

}  // namespace
}  // namespace tm_vnni
