// Linear layers over weights that stay quantized in memory: y[M, N] = x[M, K] @ W^T, fp32 in and out.
//
// Weight layout (see tokenmill/model/quant.py), per output row n, in groups of 32 along K:
//   int4: codes uint8 [N, K / 2]; group g of row n is the 16 bytes codes[n, 16g .. 16g + 15], byte j
//         holding element j in its low nibble and element j + 16 in its high nibble (GGUF's Q4_0 /
//         Q4_1 block order, so those files are used without reshuffling their nibbles).
//   int8: codes int8 [N, K].
//   scales, mins: fp16 [N, K / 32]; element value = scale * code + min (mins may be absent: 0).
//
// y[m, n] = sum_g scale[n, g] * (sum_{j in g} code[n, j] * x[m, j]) + sum_g min[n, g] * xsum[m, g],
// where xsum[m, g] is the sum of x over group g, computed once per call. Codes are widened to fp32 in
// registers and multiplied with fp32 activations: the weight values are exactly those of the file, and
// only the summation order differs from a dequantized fp32 matmul.
//
// A tile is R rows x C output columns (R <= 4, C = 4): each group's codes are unpacked once per
// tile and used for every row, and each activation load serves C columns. Threads split the output
// columns; within a thread's columns all row blocks run back to back, so a block of weights is read
// from memory once per call and from L1 for the other rows. For many rows the caller dequantizes to
// bf16 and uses oneDNN instead (model/layers/quantized_linear.py): that GEMM is ~3x faster per FLOP.
//
// As in paged_attention.cpp, the binary must not depend on the CPU it was built on: the AVX-512
// path is compiled with a target attribute and chosen at run time; other CPUs run a portable loop
// compiled twice (x86-64-v3 for AVX2 + FMA, and baseline) that the compiler vectorises.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_isa_cap.h"
#include "dense_out.h"
#include "quant_bf16.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

#define TQ_INLINE inline __attribute__((always_inline))

constexpr int64_t kGroup = 32;

struct Args {
  const float* x;      // [M, K]
  const float* xsum;   // [M, G]
  const uint8_t* codes;  // int4: [N, K/2]; int8: [N, K] (read as int8)
  const uint16_t* scales;  // fp16 [N, G]
  const uint16_t* mins;    // fp16 [N, G] or nullptr
  float* y;            // [M, N]
  int64_t M, N, K, G;
  int bits;
};

TQ_INLINE float half_to_float(uint16_t h) {
  // IEEE binary16 -> binary32 without F16C, for the portable path.
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The min term sum_g min[n, g] * xsum[m, g] for rows m0..m0+rows-1 and column n.
TQ_INLINE void add_min_terms(const Args& a, int64_t m0, int64_t rows, int64_t n, float* out) {
  if (a.mins == nullptr) return;
  const uint16_t* mn = a.mins + n * a.G;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xs = a.xsum + (m0 + r) * a.G;
    float s = 0.f;
    for (int64_t g = 0; g < a.G; ++g) s += half_to_float(mn[g]) * xs[g];
    out[r] += s;
  }
}

// ---------------------------------------------------------------------------------------------
// Portable path: unpack one group of one column to 32 fp32 weights (scaled, without the min), then
// dot it with each row. Plain loops of fixed length that GCC vectorises for the target it compiles.
#define TQ_DEFINE_GENERIC(NAME, ATTR)                                                            \
  ATTR void NAME(const Args& a, int64_t n_begin, int64_t n_end) {                                \
    float w[kGroup];                                                                             \
    float acc[4];                                                                                \
    for (int64_t n = n_begin; n < n_end; ++n) {                                                  \
      for (int64_t m0 = 0; m0 < a.M; m0 += 4) {                                                  \
        const int64_t rows = std::min<int64_t>(4, a.M - m0);                                     \
        for (int r = 0; r < 4; ++r) acc[r] = 0.f;                                                \
        for (int64_t g = 0; g < a.G; ++g) {                                                      \
          const float s = half_to_float(a.scales[n * a.G + g]);                                  \
          if (a.bits == 4) {                                                                     \
            const uint8_t* c = a.codes + n * (a.K / 2) + g * 16;                                 \
            for (int j = 0; j < 16; ++j) {                                                       \
              w[j] = static_cast<float>(c[j] & 0x0F) * s;                                        \
              w[j + 16] = static_cast<float>(c[j] >> 4) * s;                                     \
            }                                                                                    \
          } else {                                                                               \
            const int8_t* c = reinterpret_cast<const int8_t*>(a.codes) + n * a.K + g * kGroup;   \
            for (int j = 0; j < kGroup; ++j) w[j] = static_cast<float>(c[j]) * s;                \
          }                                                                                      \
          for (int64_t r = 0; r < rows; ++r) {                                                   \
            const float* xr = a.x + (m0 + r) * a.K + g * kGroup;                                 \
            float d = 0.f;                                                                       \
            for (int j = 0; j < kGroup; ++j) d += w[j] * xr[j];                                  \
            acc[r] += d;                                                                         \
          }                                                                                      \
        }                                                                                        \
        add_min_terms(a, m0, rows, n, acc);                                                      \
        for (int64_t r = 0; r < rows; ++r) a.y[(m0 + r) * a.N + n] = acc[r];                     \
      }                                                                                          \
    }                                                                                            \
  }

TQ_DEFINE_GENERIC(generic_base, )
TQ_DEFINE_GENERIC(generic_avx2, __attribute__((target("arch=x86-64-v3"))))

// ---------------------------------------------------------------------------------------------
// AVX-512 path.
#define TQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

template <int C, int Bits>
TQ_AVX512 TQ_INLINE void unpack_group(const Args& a, int64_t n0, int64_t g, __m512 (&wlo)[C], __m512 (&whi)[C]) {
  for (int c = 0; c < C; ++c) {
    const int64_t n = n0 + c;
    const __m512 s = _mm512_set1_ps(_cvtsh_ss(a.scales[n * a.G + g]));
    if constexpr (Bits == 4) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.codes + n * (a.K / 2) + g * 16));
      const __m512i wi = _mm512_cvtepu8_epi32(b);
      const __m512i lo = _mm512_and_si512(wi, _mm512_set1_epi32(0x0F));
      const __m512i hi = _mm512_srli_epi32(wi, 4);
      wlo[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), s);
      whi[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), s);
    } else {
      const uint8_t* p = a.codes + n * a.K + g * kGroup;
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
      wlo[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b0)), s);
      whi[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b1)), s);
    }
  }
}

// sum_g min[n, g] * xsum[m, g] for one row and column, 16 groups at a time.
TQ_AVX512 TQ_INLINE float min_term_avx512(const uint16_t* mn, const float* xs, int64_t G) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 k = G - g >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (G - g)) - 1);
    const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mn + g));
    acc = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(k, xs + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

template <int R, int C, int Bits>
TQ_AVX512 void tile_avx512(const Args& a, int64_t m0, int64_t n0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  __m512 wlo[C], whi[C];
  const float* xrow[R];
  for (int r = 0; r < R; ++r) xrow[r] = a.x + (m0 + r) * a.K;
  for (int64_t g = 0; g < a.G; ++g) {
    unpack_group<C, Bits>(a, n0, g, wlo, whi);
    for (int r = 0; r < R; ++r) {
      const __m512 xlo = _mm512_loadu_ps(xrow[r] + g * kGroup);
      const __m512 xhi = _mm512_loadu_ps(xrow[r] + g * kGroup + 16);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(wlo[c], xlo, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(whi[c], xhi, acc[r][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    float out[R];
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r][c]);
    if (a.mins != nullptr) {
      for (int r = 0; r < R; ++r) out[r] += min_term_avx512(a.mins + (n0 + c) * a.G, a.xsum + (m0 + r) * a.G, a.G);
    }
    for (int r = 0; r < R; ++r) a.y[(m0 + r) * a.N + n0 + c] = out[r];
  }
}

template <int C, int Bits>
TQ_AVX512 void columns_avx512(const Args& a, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= a.M; m0 += 4) tile_avx512<4, C, Bits>(a, m0, n0);
  switch (a.M - m0) {
    case 3: tile_avx512<3, C, Bits>(a, m0, n0); break;
    case 2: tile_avx512<2, C, Bits>(a, m0, n0); break;
    case 1: tile_avx512<1, C, Bits>(a, m0, n0); break;
    default: break;
  }
}

template <int Bits>
TQ_AVX512 void range_avx512(const Args& a, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (a.M == 1) {  // matrix-vector: more columns per tile keep more FMA chains in flight
    for (; n + 8 <= n_end; n += 8) tile_avx512<1, 8, Bits>(a, 0, n);
  }
  for (; n + 4 <= n_end; n += 4) columns_avx512<4, Bits>(a, n);
  for (; n < n_end; ++n) columns_avx512<1, Bits>(a, n);
}


// ---------------------------------------------------------------------------------------------
// (On AVX512-VNNI CPUs the layers use the column-blocked kernel of quant_vnni.cpp instead; this file
// serves other CPUs, and weights whose row count is not a multiple of 16.)
enum Isa : int64_t { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

Isa detect_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (tm_isa::allows(tm_isa::kCapAvx512) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c"))
    return kAvx512;
  if (tm_isa::allows(tm_isa::kCapAvx2) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kBaseline;
}

Isa selected_isa(int64_t requested) {
  static const Isa best = detect_isa();
  return requested < 0 ? best : static_cast<Isa>(std::min<int64_t>(requested, best));
}

void check_weights(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
                   int64_t N, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(K % kGroup == 0, "the input size ", K, " is not a multiple of ", kGroup);
  TORCH_CHECK(codes.dim() == 2 && codes.size(0) == N && codes.size(1) == (bits == 4 ? K / 2 : K),
              "codes must be [N, K/2] (int4) or [N, K] (int8)");
  TORCH_CHECK(codes.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "codes must be uint8 (int4) or int8");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "codes and scales must be contiguous");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == K / kGroup,
              "scales must be float16 [N, K/32]");
  if (mins.numel() > 0) {
    TORCH_CHECK(mins.scalar_type() == at::kHalf && mins.sizes() == scales.sizes() && mins.is_contiguous(),
                "mins must be float16 [N, K/32] like scales, or empty");
  }
}

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, int64_t bits, int64_t isa) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = codes.size(0);
  check_weights(codes, scales, mins, bits, N, K);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int64_t G = K / kGroup;
  const Isa chosen = selected_isa(isa);
  at::Tensor xsum = x.view({M, G, kGroup}).sum(-1).contiguous();

  Args a{};
  a.x = x.data_ptr<float>();
  a.xsum = xsum.data_ptr<float>();
  a.codes = static_cast<const uint8_t*>(codes.data_ptr());
  a.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  a.mins = mins.numel() > 0 ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  a.y = y.data_ptr<float>();
  a.M = M;
  a.N = N;
  a.K = K;
  a.G = G;
  a.bits = static_cast<int>(bits);

  // Work is split in blocks of 16 columns (multiples of the 4-column tile); at least ~64k weights
  // per thread chunk so that small layers do not pay a fork for nothing.
  const int64_t blocks = (N + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, 65536 / (16 * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * 16, n1 = std::min(N, b1 * 16);
    if (chosen >= kAvx512) {
      if (bits == 4) range_avx512<4>(a, n0, n1);
      else range_avx512<8>(a, n0, n1);
    } else if (chosen == kAvx2) {
      generic_avx2(a, n0, n1);
    } else {
      generic_base(a, n0, n1);
    }
  });
  return y;
}

// Dequantize columns n0..n1 to fp32 or bf16 (round to nearest even), 32 values per group.
template <int Bits, bool Bf16>
TQ_AVX512 void dequantize_avx512(const Args& a, int64_t n0, int64_t n1, void* out) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < a.G; ++g) {
      __m512 wlo[1], whi[1];
      unpack_group<1, Bits>(a, n, g, wlo, whi);
      if (a.mins != nullptr) {
        const __m512 m = _mm512_set1_ps(_cvtsh_ss(a.mins[n * a.G + g]));
        wlo[0] = _mm512_add_ps(wlo[0], m);
        whi[0] = _mm512_add_ps(whi[0], m);
      }
      const int64_t at = n * a.K + g * kGroup;
      if constexpr (Bf16) {
        uint16_t* o = static_cast<uint16_t*>(out) + at;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), tm_bf16::to_bf16(wlo[0]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), tm_bf16::to_bf16(whi[0]));
      } else {
        float* o = static_cast<float*>(out) + at;
        _mm512_storeu_ps(o, wlo[0]);
        _mm512_storeu_ps(o + 16, whi[0]);
      }
    }
  }
}

// The weights as a dense matrix [N, K] of `dtype` (float32 or bfloat16): the exact values scale *
// code + min, rounded once to the output type.
// `into`: the caller's contiguous [N, K] buffer of `dtype` (a reused scratch, dense_out.h), else a new one.
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
                      int64_t K, at::ScalarType dtype, const at::Tensor* into = nullptr) {
  const int64_t N = codes.size(0);
  check_weights(codes, scales, mins, bits, N, K);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to float32 or bfloat16 only");
  if (into != nullptr) tm_dense::check_dense_out(*into, N, K, dtype);
  if (selected_isa(-1) >= kAvx512) {
    at::Tensor fast = into != nullptr ? *into : at::empty({N, K}, codes.options().dtype(dtype));
    Args a{};
    a.codes = static_cast<const uint8_t*>(codes.data_ptr());
    a.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
    a.mins = mins.numel() > 0 ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
    a.N = N;
    a.K = K;
    a.G = K / kGroup;
    const bool bf16 = dtype == at::kBFloat16;
    at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t n0, int64_t n1) {
      if (bits == 4) bf16 ? dequantize_avx512<4, true>(a, n0, n1, fast.data_ptr()) : dequantize_avx512<4, false>(a, n0, n1, fast.data_ptr());
      else bf16 ? dequantize_avx512<8, true>(a, n0, n1, fast.data_ptr()) : dequantize_avx512<8, false>(a, n0, n1, fast.data_ptr());
    });
    return fast;
  }
  at::Tensor out = at::empty({N, K}, codes.options().dtype(at::kFloat));
  const int64_t G = K / kGroup;
  const uint8_t* c = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const uint16_t* mn = mins.numel() > 0 ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        const float sc = half_to_float(s[n * G + g]);
        const float m = mn ? half_to_float(mn[n * G + g]) : 0.f;
        float* row = o + n * K + g * kGroup;
        if (bits == 4) {
          const uint8_t* b = c + n * (K / 2) + g * 16;
          for (int j = 0; j < 16; ++j) {
            row[j] = static_cast<float>(b[j] & 0x0F) * sc + m;
            row[j + 16] = static_cast<float>(b[j] >> 4) * sc + m;
          }
        } else {
          const int8_t* b = reinterpret_cast<const int8_t*>(c) + n * K + g * kGroup;
          for (int j = 0; j < kGroup; ++j) row[j] = static_cast<float>(b[j]) * sc + m;
        }
      }
    }
  });
  if (into != nullptr) return into->copy_(out);
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor dequantize_op(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
                         int64_t K, bool bf16) {
  return dequantize(codes, scales, mins, bits, K, bf16 ? at::kBFloat16 : at::kFloat);
}

void dequantize_into_op(at::Tensor out, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                        int64_t bits, int64_t K) {
  dequantize(codes, scales, mins, bits, K, out.scalar_type(), &out);
}

int64_t best_isa() { return static_cast<int64_t>(selected_isa(-1)); }

}  // namespace

TORCH_LIBRARY(tokenmill_quant, m) {
  m.def("linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits, int isa=-1) -> Tensor", &quant_linear);
  m.def("dequantize(Tensor codes, Tensor scales, Tensor mins, int bits, int K, bool bf16=False) -> Tensor",
        &dequantize_op);
  m.def("dequantize_into(Tensor(a!) out, Tensor codes, Tensor scales, Tensor mins, int bits, int K) -> ()",
        &dequantize_into_op);
  m.def("best_isa() -> int", &best_isa);
}
