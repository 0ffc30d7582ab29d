// The blocked quantized-linear ops on AVX2 CPUs (the kernel: quant_avx2.h; the layout and formats:
// quant_vnni.h, quant_blocks.h). Same op signatures as tokenmill_vnni's, so the Python side picks a
// namespace, not a call shape; plus `dequantize`, the fp32 matrix those CPUs' prompt GEMMs take.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "blocked_ops.h"
#include "dense_out.h"
#include "quant_avx2.h"

#include <algorithm>
#include <vector>

namespace {

using namespace tm_avx2;
using tm_vnni::with_decoder;

Weights checked(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& subs,
                int64_t fmt, int64_t N, int64_t K) {
  TORCH_CHECK(avx2_supported(), "this CPU has no AVX2 (or TOKENMILL_CPU_ISA does not allow it)");
  return tm_vnni::check_shapes(codes, scales, mins, subs, fmt, N, K);
}

// y [M, N] = x @ W^T for weights side by side (one, or the parts of a fused linear whose formats
// differ: part i's column blocks start at block0[i], block0 ends with N / 16), x rounded once.
at::Tensor multiply(const at::Tensor& x, const std::vector<Weights>& w, const std::vector<int64_t>& block0,
                    int64_t terms) {
  const int64_t M = x.size(0), K = x.size(1), nblocks = block0.back(), N = nblocks * kCols;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  at::Tensor scratch;
  const tm_vnni::Acts a = tm_vnni::acts_scratch(M, K, kLayoutTerms, x, scratch);  // merged int16 values
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows are rounded once (by one thread for a decode step: no fork for 1-2 rows), then threads take
  // column blocks, at least ~32k weights each.
  auto round = [&](int64_t m0, int64_t m1) {
    if (terms == 2) round_rows<2>(xp, K, m0, m1, a);
    else round_rows<1>(xp, K, m0, m1, a);
  };
  if (M <= 16) round(0, M);
  else at::parallel_for(0, M, 16, round);
  const int64_t grain = std::max<int64_t>(1, 32768 / (kCols * K));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < w.size(); ++i) {
      const int64_t lo = std::max(b0, block0[i]), hi = std::min(b1, block0[i + 1]);
      if (lo >= hi) continue;
      float* yi = yp + block0[i] * kCols;
      if (terms == 2) blocks<2>(w[i], a, 0, M, N, lo - block0[i], hi - block0[i], yi);
      else blocks<1>(w[i], a, 0, M, N, lo - block0[i], hi - block0[i], yi);
    }
  });
  return y;
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                  const at::Tensor& subs, int64_t fmt, int64_t N, int64_t terms) {
  const at::Tensor x = tm_vnni::checked_x(x_in, terms);
  return multiply(x, {checked(codes, scales, mins, subs, fmt, N, x.size(1))}, {0, N / kCols}, terms);
}

// Several weights over the same x, outputs side by side (quant_vnni.cpp linear_parts).
at::Tensor linear_parts(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef fmts, at::IntArrayRef Ns,
                        int64_t terms) {
  const at::Tensor x = tm_vnni::checked_x(x_in, terms);
  const tm_vnni::Parts parts = tm_vnni::parts_of(weights, fmts, Ns, x.size(1), checked);
  return multiply(x, parts.w, parts.block0, terms);
}

template <class D>
T2_TARGET void dequantize_blocks(const Weights& w, int64_t K, int64_t nb0, int64_t nb1, float* out) {
  for (int64_t nb = nb0; nb < nb1; ++nb)
    for (int half = 0; half < 2; ++half)
      for (int64_t g = 0; g < w.G; ++g)
        decode_half<D>(w, nb, g, half, MatrixSink{out + (nb * kCols + kHalf * half) * K + g * kGroup, K});
}

// The whole weight as fp32 [N, K]: gguf-py's values (a prompt step's GEMM on CPUs without a native bf16 one).
void dequantize_to(const Weights& w, int64_t N, int64_t K, at::Tensor& out) {
  float* o = out.data_ptr<float>();
  with_decoder(w.fmt, [&]<class D>() {
    at::parallel_for(0, N / kCols, 1, [&](int64_t b0, int64_t b1) { dequantize_blocks<D>(w, K, b0, b1, o); });
  });
}

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& subs,
                      int64_t fmt, int64_t N, int64_t K) {
  const Weights w = checked(codes, scales, mins, subs, fmt, N, K);
  at::Tensor out = at::empty({N, K}, scales.options().dtype(at::kFloat));
  dequantize_to(w, N, K, out);
  return out;
}

// The same into the caller's contiguous fp32 [N, K] buffer (a reused scratch, dense_out.h).
void dequantize_into(at::Tensor out, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     const at::Tensor& subs, int64_t fmt, int64_t N, int64_t K) {
  const Weights w = checked(codes, scales, mins, subs, fmt, N, K);
  tm_dense::check_dense_out(out, N, K, at::kFloat);
  dequantize_to(w, N, K, out);
}

template <class D>
T2_TARGET void lookup_rows(const Weights& w, int64_t K, const int64_t* ids, int64_t t0, int64_t t1, float* out) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t nb = ids[t] / kCols, c = ids[t] % kCols;
    for (int64_t g = 0; g < w.G; ++g)
      decode_half<D>(w, nb, g, static_cast<int>(c / kHalf), ColumnSink{out + t * K + g * kGroup, static_cast<int>(c % kHalf)});
  }
}

at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                           const at::Tensor& subs, int64_t fmt, int64_t N, int64_t K, const at::Tensor& ids_in) {
  const Weights w = checked(codes, scales, mins, subs, fmt, N, K);
  const at::Tensor ids = tm_vnni::checked_ids(ids_in, N);
  const int64_t T = ids.numel();
  at::Tensor out = at::empty({T, K}, scales.options().dtype(at::kFloat));
  const int64_t* idp = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  with_decoder(w.fmt, [&]<class D>() {
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) { lookup_rows<D>(w, K, idp, t0, t1, o); });
  });
  return out;
}

bool supported() { return avx2_supported(); }

}  // namespace

TORCH_LIBRARY(tokenmill_avx2, m) {
  m.def("linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N, int terms=2) -> Tensor",
        &linear);
  m.def("linear_parts(Tensor x, Tensor[] weights, int[] fmts, int[] Ns, int terms=2) -> Tensor", &linear_parts);
  m.def("dequantize(Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N, int K) -> Tensor",
        &dequantize);
  m.def("dequantize_into(Tensor(a!) out, Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N, "
        "int K) -> ()", &dequantize_into);
  m.def("dequantize_rows(Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N, int K, Tensor ids) "
        "-> Tensor", &dequantize_rows);
  m.def("supported() -> bool", &supported);
}
