#pragma once
// The exp approximation the fast path's kernels share (softmax in the paged-attention kernels, SiLU
// in fused_ops.h): one polynomial for scalars and for vectors, so every caller rounds alike.

#include <bit>
#include <cstdint>

namespace tm_math {

// exp(x) for x <= 0 (scores after max subtraction), Cephes-style: 2^n * P(r), relative error ~1e-7.
// Branch-free and free of library calls so that it vectorises inside `omp simd` loops. F is float
// (I int32_t) or a GCC vector of floats (I the vector of int32 of the same lanes): the same steps.
template <typename F, typename I>
inline __attribute__((always_inline)) F exp_nonpos_t(F x) {
  const F lowest = F{} - 87.0f;  // exp(-87) ~ 1.6e-38 stays a normal float; lower values are ~0 anyway
  x = x < lowest ? lowest : x;
  const F shifter = F{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const F t = x * 1.44269504088896341f + shifter;
  const F n = t - shifter;
  const I ni = std::bit_cast<I>(t) - std::bit_cast<I>(shifter);
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const F z = r * r;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r + 1.0f;
  return p * std::bit_cast<F>((ni + 127) << 23);
}

inline __attribute__((always_inline)) float exp_nonpos(float x) { return exp_nonpos_t<float, int32_t>(x); }

// silu(x) * u = x * sigmoid(x) * u, sigmoid from exp(-|x|) (no overflow): fused_ops.h's silu_mul and
// the AMX tiles' gate / up epilogue (quant_amx.h), for floats or GCC vectors of them alike.
template <typename F, typename I>
inline __attribute__((always_inline)) F silu_mul_t(F x, F u) {
  const F e = exp_nonpos_t<F, I>(x > 0.f ? -x : x);
  const F sig = x > 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return x * sig * u;
}

}  // namespace tm_math
