#pragma once
// fp32 -> bf16 rounding of 16 values, shared by both quantized-linear kernels' dequantize-to-bf16
// paths (quant_linear.cpp's row layout, quant_vnni.cpp's blocked one), which hand oneDNN the weights.
//
// Why not _mm512_cvtneps_pbh: it needs AVX512-BF16, which the row-layout kernel's CPUs may lack. The
// target is the plain AVX-512 subset, so that both kernels (whose own targets include it) inline it.

#include <immintrin.h>

namespace tm_bf16 {

// Round to nearest even; weights are finite, so NaN needs no case of its own.
__attribute__((target("avx512f"))) inline __attribute__((always_inline)) __m256i to_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

}  // namespace tm_bf16
