// Quantized linear layers on AVX512-VNNI over a column-blocked weight layout, y[M, N] = x[M, K] @ W^T.
//
// Why a second layout: with weights in row order (quant_linear.cpp), each int32 lane of a dot
// product belongs to one output column's partial sum over K, so every group of 32 needs its scale
// broadcast into a lane pattern and the lanes reduced at the end: ~15 instructions per 64 weights,
// which made batch-1 decode compute-bound. Here a zmm holds 4 consecutive k of 16 output columns
// (model/quant.py `to_blocked`), so one vpdpbusd adds x[k..k+3] (broadcast) times 16 columns' codes
// into 16 column accumulators: a group of 32 is 8 vpdpbusd per row, its scales one fp16 load for 16
// columns, and there is no horizontal reduction at all (the 16 results are 16 adjacent outputs).
//
// Blocked layout, per block of 16 output columns (nb) and group of 32 inputs (g):
//   int4: codes uint8 [N/16, G, 4, 64]: zmm t holds quad t in its low nibbles and quad t + 4 in its
//         high nibbles; quad j, byte c * 4 + e = code of column 16 nb + c at k = 32 g + 4 j + e.
//   int8: codes uint8 [N/16, G, 8, 64]: zmm j = quad j, same byte order, each code stored + 128.
//   scales, mins: fp16 [N/16, G, 16].
//
// Activations are rounded to int8 per group of 32 (scale amax / 127, nearest even), as llama.cpp's
// Q8 activations, and with `terms` = 2 the rounding residual is rounded to int8 again (its own scale,
// ~1/254 of the first): x ~ d1 q1 + d2 q2, about 15 bits per activation for 8 more vpdpbusd per group
// and row. One term measured KL(exact || fast) 0.0028 nats and top-1 agreement 97% on held-out text,
// two terms are within rounding of fp32 activations (docs/benchmarks.md). The min term uses the rounded
// activations' sums so that rounding errors cancel.
// vpdpbusd multiplies unsigned by signed bytes: the codes are the unsigned side (int8 codes stored
// + 128, so the dot product gains 128 * sum(x) per group, subtracted from the activations' side:
// no extra bytes per weight).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

#define TV_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define TV_INLINE inline __attribute__((always_inline))

constexpr int64_t kGroup = 32;
constexpr int64_t kCols = 16;

struct Acts {
  const int8_t* xq;    // [M, terms, K] rounded activations (term 2: the residual of term 1)
  const float* dx;     // [M, G, terms] scale per group and term
  const float* qsum;   // [M, G] sum over terms of dx * sum of the group's rounded values (min term)
  const int32_t* sum128;  // [M, G, terms] 128 * sum of the group's rounded values (int8 weights' offset)
  int64_t K;
};

struct Weights {
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* mins;   // or nullptr
  int64_t G;
  int bits;
};

TV_TARGET void quantize_rows(const float* x, int64_t M, int64_t K, int terms, int8_t* xq, float* dx, float* qsum,
                             int32_t* sum128) {
  const int64_t G = K / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = x + m * K + g * kGroup;
      __m512 lo = _mm512_loadu_ps(src);
      __m512 hi = _mm512_loadu_ps(src + 16);
      float total_sum = 0.f;
      for (int t = 0; t < terms; ++t) {
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      const float scale = amax / 127.f;
      const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      dx[(m * G + g) * terms + t] = scale;
      total_sum += scale * static_cast<float>(total);
      sum128[(m * G + g) * terms + t] = 128 * total;
      int8_t* dst = xq + (m * terms + t) * K + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
      // what this term left out, for the next one
      const __m512 s = _mm512_set1_ps(scale);
      lo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo), s, lo);
      hi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi), s, hi);
      }
      qsum[m * G + g] = total_sum;
    }
  }
}

TV_TARGET TV_INLINE __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The 8 quads (16 columns x 4 inputs of unsigned codes each) of one block of 16 columns and 32 inputs.
TV_TARGET TV_INLINE void unpack_block(const Weights& w, int64_t blk, int bits, __m512i (&q)[8]) {
  if (bits == 4) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const uint8_t* p = w.codes + blk * 256;
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(p + t * 64);
      q[t] = _mm512_and_si512(v, nibble);
      q[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
  } else {
    for (int j = 0; j < 8; ++j) q[j] = _mm512_loadu_si512(w.codes + blk * 512 + j * 64);
  }
}

// R rows (m0..m0+R-1) x 16 columns of block nb.
template <int R, int Bits, int Terms>
TV_TARGET void tile(const Weights& w, const Acts& a, int64_t K, int64_t N, int64_t m0, int64_t nb, float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.G; ++g) {
    const int64_t blk = nb * w.G + g;
    __m512i q[8];
    unpack_block(w, blk, Bits, q);
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + blk * kCols)));
    __m512 mn = _mm512_setzero_ps();
    if (w.mins != nullptr) mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + blk * kCols)));
    for (int r = 0; r < R; ++r) {
      const int64_t ag = (m0 + r) * w.G + g;
      for (int t = 0; t < Terms; ++t) {
        const int8_t* xr = a.xq + ((m0 + r) * Terms + t) * K + g * kGroup;
        __m512i dot = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, q[j], bcast4(xr + 4 * j));
        if constexpr (Bits == 8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(a.sum128[ag * Terms + t]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sc, _mm512_set1_ps(a.dx[ag * Terms + t])),
                                 acc[r]);
      }
      if (w.mins != nullptr) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.qsum[ag]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + nb * kCols, acc[r]);
}

template <int Bits, int Terms>
TV_TARGET void blocks(const Weights& w, const Acts& a, int64_t M, int64_t K, int64_t N, int64_t nb0, int64_t nb1,
                      float* y) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) tile<8, Bits, Terms>(w, a, K, N, m0, nb, y);
    switch (M - m0) {
      case 7: tile<7, Bits, Terms>(w, a, K, N, m0, nb, y); break;
      case 6: tile<6, Bits, Terms>(w, a, K, N, m0, nb, y); break;
      case 5: tile<5, Bits, Terms>(w, a, K, N, m0, nb, y); break;
      case 4: tile<4, Bits, Terms>(w, a, K, N, m0, nb, y); break;
      case 3: tile<3, Bits, Terms>(w, a, K, N, m0, nb, y); break;
      case 2: tile<2, Bits, Terms>(w, a, K, N, m0, nb, y); break;
      case 1: tile<1, Bits, Terms>(w, a, K, N, m0, nb, y); break;
      default: break;
    }
  }
}

bool vnni_supported() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  }();
  return yes;
#else
  return false;
#endif
}

Weights check(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t bits, int64_t N,
              int64_t K) {
  TORCH_CHECK(vnni_supported(), "this CPU has no AVX512-VNNI");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(N % kCols == 0 && K % kGroup == 0, "N must be a multiple of 16 and K of 32");
  const int64_t G = K / kGroup;
  TORCH_CHECK(codes.is_contiguous() && codes.numel() == N * K / (bits == 4 ? 2 : 1) && codes.element_size() == 1,
              "codes do not match [N/16, G, ...] for this N and K");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf && scales.numel() == N * G,
              "scales must be float16 [N/16, G, 16]");
  if (mins.numel() > 0) {
    TORCH_CHECK(mins.is_contiguous() && mins.scalar_type() == at::kHalf && mins.numel() == N * G,
                "mins must be float16 [N/16, G, 16] or empty");
  }
  Weights w{};
  w.codes = static_cast<const uint8_t*>(codes.data_ptr());
  w.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  w.mins = mins.numel() > 0 ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  w.G = G;
  w.bits = static_cast<int>(bits);
  return w;
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                  int64_t bits, int64_t N, int64_t terms) {
  TORCH_CHECK(terms == 1 || terms == 2, "terms must be 1 or 2");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const Weights w = check(codes, scales, mins, bits, N, K);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  // One scratch allocation for the quantized activations and their per-group numbers (an allocation
  // per array was ~0.2 ms of a 6 ms batch-1 step: 121 calls a token).
  const int64_t groups = M * w.G;
  at::Tensor scratch = at::empty({groups * (2 * terms + 1) * 4 + M * terms * K}, x.options().dtype(at::kByte));
  float* dx = reinterpret_cast<float*>(scratch.data_ptr<uint8_t>());
  float* qsum = dx + groups * terms;
  int32_t* sum128 = reinterpret_cast<int32_t*>(qsum + groups);
  int8_t* xq = reinterpret_cast<int8_t*>(sum128 + groups * terms);
  quantize_rows(x.data_ptr<float>(), M, K, static_cast<int>(terms), xq, dx, qsum, sum128);
  Acts a{xq, dx, qsum, sum128, K};
  float* yp = y.data_ptr<float>();
  const int64_t nblocks = N / kCols;
  // At least ~32k weights per thread chunk: small layers do not pay a fork for nothing.
  const int64_t grain = std::max<int64_t>(1, 32768 / (kCols * K));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    if (terms == 2) {
      if (bits == 4) blocks<4, 2>(w, a, M, K, N, b0, b1, yp);
      else blocks<8, 2>(w, a, M, K, N, b0, b1, yp);
    } else {
      if (bits == 4) blocks<4, 1>(w, a, M, K, N, b0, b1, yp);
      else blocks<8, 1>(w, a, M, K, N, b0, b1, yp);
    }
  });
  return y;
}

TV_TARGET float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

TV_TARGET TV_INLINE __m256i to_bf16(__m512 v) {  // round to nearest even (weights are finite)
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// The whole weight as a dense bf16 [N, K] matrix, for large batches: oneDNN's bf16 GEMM over it
// beats the two-term VNNI kernel from a few hundred rows (model/layers/quantized_linear.py).
TV_TARGET void dequantize_blocks(const Weights& w, int64_t K, int64_t nb0, int64_t nb1, uint16_t* out) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    for (int64_t g = 0; g < w.G; ++g) {
      const int64_t blk = nb * w.G + g;
      __m512i q[8];
      unpack_block(w, blk, w.bits, q);
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + blk * kCols)));
      __m512 mn = w.mins ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + blk * kCols)))
                         : _mm512_setzero_ps();
      if (w.bits == 8) mn = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), sc, mn);  // codes are stored + 128
      for (int part = 0; part < 4; ++part) {  // columns 4 part .. 4 part + 3
        const __m512i idx = _mm512_add_epi32(_mm512_srli_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2), _mm512_set1_epi32(4 * part));
        const __m512 s = _mm512_permutexvar_ps(idx, sc), m = _mm512_permutexvar_ps(idx, mn);
        for (int j = 0; j < 8; ++j) {
          const __m512i codes = _mm512_cvtepu8_epi32(
              part == 0 ? _mm512_extracti32x4_epi32(q[j], 0)
              : part == 1 ? _mm512_extracti32x4_epi32(q[j], 1)
              : part == 2 ? _mm512_extracti32x4_epi32(q[j], 2) : _mm512_extracti32x4_epi32(q[j], 3));
          const __m256i b = to_bf16(_mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), s, m));
          // lanes: column 4 part + c, inputs 4 j .. 4 j + 3 (c = lane / 4): 8 bytes per column
          alignas(32) uint64_t lanes[4];
          _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), b);
          for (int c = 0; c < 4; ++c) {
            std::memcpy(out + (nb * kCols + 4 * part + c) * K + g * kGroup + 4 * j, &lanes[c], 8);
          }
        }
      }
    }
  }
}

at::Tensor dequantize_bf16(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
                           int64_t N, int64_t K) {
  const Weights w = check(codes, scales, mins, bits, N, K);
  at::Tensor out = at::empty({N, K}, scales.options().dtype(at::kBFloat16));
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, N / kCols, 1, [&](int64_t b0, int64_t b1) { dequantize_blocks(w, K, b0, b1, o); });
  return out;
}

// Rows `ids` of the weight as fp32 [T, K] (embedding lookups of a tied, blocked weight).
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
                           int64_t N, int64_t K, const at::Tensor& ids_in) {
  const Weights w = check(codes, scales, mins, bits, N, K);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = ids.numel();
  at::Tensor out = at::empty({T, K}, scales.options().dtype(at::kFloat));
  const int64_t* idp = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = idp[t];
    TORCH_CHECK(n >= 0 && n < N, "row id ", n, " is outside [0, ", N, ")");
    const int64_t nb = n / kCols, c = n % kCols;
    for (int64_t g = 0; g < w.G; ++g) {
      const int64_t blk = nb * w.G + g;
      const float s = half_to_float(w.scales[blk * kCols + c]);
      const float m = w.mins ? half_to_float(w.mins[blk * kCols + c]) : 0.f;
      for (int64_t j = 0; j < 8; ++j) {
        for (int64_t e = 0; e < 4; ++e) {
          int code;
          if (bits == 4) {
            const uint8_t b = w.codes[blk * 256 + (j % 4) * 64 + c * 4 + e];
            code = j < 4 ? (b & 0x0F) : (b >> 4);
          } else {
            code = static_cast<int>(w.codes[blk * 512 + j * 64 + c * 4 + e]) - 128;
          }
          o[t * K + g * kGroup + j * 4 + e] = static_cast<float>(code) * s + m;
        }
      }
    }
  }
  return out;
}

bool supported() { return vnni_supported(); }

}  // namespace

TORCH_LIBRARY(tokenmill_vnni, m) {
  m.def("linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits, int N, int terms=2) -> Tensor", &linear);
  m.def("dequantize_rows(Tensor codes, Tensor scales, Tensor mins, int bits, int N, int K, Tensor ids) -> Tensor",
        &dequantize_rows);
  m.def("dequantize_bf16(Tensor codes, Tensor scales, Tensor mins, int bits, int N, int K) -> Tensor",
        &dequantize_bf16);
  m.def("supported() -> bool", &supported);
}
