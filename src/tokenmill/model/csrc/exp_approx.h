#pragma once
// The exp approximation the fast path's kernels share (softmax in paged_attention.h, SiLU in
// fused_ops.h): one definition, so both round alike.

#include <bit>
#include <cstdint>

namespace tm_math {

// exp(x) for x <= 0 (scores after max subtraction), Cephes-style: 2^n * P(r), relative error ~1e-7.
// Branch-free and free of library calls so that it vectorises inside `omp simd` loops.
inline __attribute__((always_inline)) float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;  // exp(-87) ~ 1.6e-38 stays a normal float; lower values are ~0 anyway
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  float t = x * 1.44269504088896341f + shifter;
  float n = t - shifter;
  int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(shifter);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float z = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r + 1.0f;
  return p * std::bit_cast<float>((ni + 127) << 23);
}

}  // namespace tm_math
