#pragma once
// Fused elementwise steps of a decoder layer for the fast path, one call each instead of several
// PyTorch ops: at batch 1 a decode step is ~20 tiny ops per layer, and their per-op overhead costs
// as much as reading the layer's quantized weights (docs/benchmarks.md).
//
//   rope_qk(qkv, cos, sin, nq, nkv) -> (q, k): RoPE (HF's rotate_half form) on the q and k heads of
//       a fused q/k/v projection, written to contiguous [T, heads, head_dim] tensors.
//   rope_store(qkv, cos, sin, nq, nkv, k_cache, v_cache, slots, q_bf16) -> q: the same, but k (roped)
//       and v go straight to their cache slots (caches [kv_heads, slots, row] of any format in
//       kv_cache_format.h: fp32, bf16, or int8 rows quantized here); q in bf16 where the step's
//       attention reads bf16 queries (prompt_attention.py), rounded once from the same floats.
//   silu_mul(gate_up) -> silu(gate) * up, for gate_up = [gate | up] along the last dim.
//   add_rms_norm_(x, delta, w, eps) -> x += delta (in place), then returns RMSNorm(x) * w.
//   weighted_index_add_(out, rows, y, w): out[rows[i]] += y[i] * w[i] (a MoE expert's weighted
//       outputs), rounded as torch's mul_ then index_add_ round them.
//   merge_attention(own, prefix, share, bf16_out) -> own + (prefix - own) * share: a long chunk's
//       attention over its prefix and over itself merged (prompt_attention.py), in one pass.
//   int8_rows_values(rows, unrotate) -> int8 cache rows as bf16 values (code x scale, rotated back
//       out of H's frame with `unrotate`), for the prompt's flash attention (prompt_attention.py).
//
// Rounding differs from the eager ops in the last bits (FMA contraction, the exp approximation in
// silu), which is why only fast mode uses them. Rows are spread over threads only when there are
// many (prefill); a few decode rows run on the calling thread, with no fork/join.
//
// The binary must not depend on the build machine's CPU: every op is compiled for x86-64-v4
// (AVX-512) and for the baseline, and the variant is picked at run time.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <torch/library.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_isa_cap.h"
#include "exp_approx.h"
#include "kv_cache_format.h"

namespace tm_fused {
namespace {

#define TF_INLINE inline __attribute__((always_inline))

// fp32 -> bf16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN. Branch-free
// so that it vectorises.
TF_INLINE uint16_t to_bf16(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? ((b >> 16) | 0x40u) : rounded);
}

// Elements are read and written as fp32 or bf16 (uint16_t), computed in fp32: large prefill steps
// keep the linears' bf16 inputs and outputs in bf16 (no conversion pass on either side).
TF_INLINE float load(const float* p, int64_t i) { return p[i]; }
TF_INLINE float load(const uint16_t* p, int64_t i) { return std::bit_cast<float>(static_cast<uint32_t>(p[i]) << 16); }
TF_INLINE void put(float* p, int64_t i, float v) { p[i] = v; }
TF_INLINE void put(uint16_t* p, int64_t i, float v) { p[i] = to_bf16(v); }

// Adding then subtracting 1.5 * 2^23 rounds a float of magnitude < 2^22 to an integer, ties to even
// (as torch.round), branch-free.
constexpr float kRoundShifter = 12582912.0f;

#define TF_DEFINE_VARIANT(SUFFIX, ATTR)                                                              \
  template <typename In, typename Out>                                                               \
  ATTR TF_INLINE void rope_head_##SUFFIX(const In* x, const float* c, const float* s, int64_t half,   \
                                         Out* o) {                                                   \
    _Pragma("omp simd") for (int64_t i = 0; i < half; ++i) {                                         \
      const float a = load(x, i), b = load(x, i + half);                                             \
      put(o, i, a * c[i] - b * s[i]);                                                                \
      put(o, i + half, b * c[i + half] + a * s[i + half]);                                           \
    }                                                                                                \
  }                                                                                                  \
  /* q heads into Q (float, or bf16 rounded from the same float), k heads into float k */            \
  template <typename In, typename Q>                                                                 \
  ATTR void rope_rows_##SUFFIX(const In* qkv, int64_t row_stride, const float* cos, const float* sin, \
                               int64_t nq, int64_t nkv, int64_t d, Q* q, float* k, int64_t t0,        \
                               int64_t t1) {                                                        \
    const int64_t half = d / 2;                                                                      \
    for (int64_t t = t0; t < t1; ++t) {                                                              \
      const float* c = cos + t * d;                                                                  \
      const float* s = sin + t * d;                                                                  \
      const In* x = qkv + t * row_stride;                                                            \
      for (int64_t h = 0; h < nq; ++h) rope_head_##SUFFIX(x + h * d, c, s, half, q + (t * nq + h) * d); \
      for (int64_t h = 0; h < nkv; ++h)                                                              \
        rope_head_##SUFFIX(x + (nq + h) * d, c, s, half, k + (t * nkv + h) * d);                     \
    }                                                                                                \
  }                                                                                                  \
  template <typename In, typename Out>                                                               \
  ATTR void silu_mul_rows_##SUFFIX(const In* gu, int64_t inter, Out* out, int64_t t0, int64_t t1) {  \
    for (int64_t t = t0; t < t1; ++t) {                                                              \
      const In* g = gu + t * 2 * inter;                                                              \
      const In* u = g + inter;                                                                       \
      Out* o = out + t * inter;                                                                      \
      _Pragma("omp simd") for (int64_t i = 0; i < inter; ++i)                                        \
        put(o, i, tm_math::silu_mul_t<float, int32_t>(load(g, i), load(u, i)));                       \
    }                                                                                                \
  }                                                                                                  \
  template <typename In, typename Out>                                                               \
  ATTR void add_rms_norm_rows_##SUFFIX(float* x, const In* delta, const float* w, int64_t hidden,     \
                                       float eps, Out* out, int64_t t0, int64_t t1) {               \
    for (int64_t t = t0; t < t1; ++t) {                                                              \
      float* xr = x + t * hidden;                                                                    \
      const In* dr = delta + t * hidden;                                                             \
      float ss = 0.f;                                                                                \
      _Pragma("omp simd reduction(+ : ss)") for (int64_t i = 0; i < hidden; ++i) {                   \
        const float v = xr[i] + load(dr, i);                                                         \
        xr[i] = v;                                                                                   \
        ss += v * v;                                                                                 \
      }                                                                                              \
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);                      \
      Out* o = out + t * hidden;                                                                     \
      _Pragma("omp simd") for (int64_t i = 0; i < hidden; ++i) put(o, i, w[i] * (xr[i] * inv));      \
    }                                                                                                \
  }                                                                                                  \
  /* an int8 cache row's values: code x scale in fp32 (torch's int8 -> float, then one product) */   \
  ATTR void int8_values_##SUFFIX(const int8_t* row, float* x, int64_t n) {                           \
    float scale;                                                                                     \
    std::memcpy(&scale, row, sizeof(scale));                                                         \
    const int8_t* codes = row + tm_kv::kInt8ScaleBytes;                                              \
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(codes[i]) * scale; \
  }                                                                                                  \
  template <typename In, typename Out>                                                               \
  ATTR void convert_##SUFFIX(const In* src, Out* dst, int64_t n) {                                   \
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) put(dst, i, load(src, i));                   \
  }                                                                                                  \
  /* an int8 cache row: scale = max|x| / 127 first, then the codes, rounded to nearest even */      \
  template <typename In>                                                                             \
  ATTR void quantize_row_##SUFFIX(const In* src, int8_t* row, int64_t n) {                           \
    float amax = 0.f;                                                                                \
    _Pragma("omp simd reduction(max : amax)") for (int64_t i = 0; i < n; ++i) {                      \
      const float a = std::fabs(load(src, i));                                                       \
      amax = a > amax ? a : amax;                                                                    \
    }                                                                                                \
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;                         \
    std::memcpy(row, &scale, sizeof(scale));                                                         \
    int8_t* codes = row + tm_kv::kInt8ScaleBytes;                                                    \
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) {                                            \
      const float x = load(src, i) * inv;                                                            \
      codes[i] = static_cast<int8_t>((x + kRoundShifter) - kRoundShifter);                           \
    }                                                                                                \
  }

TF_DEFINE_VARIANT(base, )
TF_DEFINE_VARIANT(avx2, __attribute__((target("arch=x86-64-v3"))))
TF_DEFINE_VARIANT(avx512, __attribute__((target("arch=x86-64-v4,prefer-vector-width=512"))))

// o += y * w over n floats, the product rounded before the sum (no fused multiply-add), as torch's
// mul_ then add compute it: the loop vectorises without contraction.
__attribute__((optimize("fp-contract=off"))) inline void weighted_add_row(float* o, const float* y, float w, int64_t n) {
  _Pragma("omp simd") for (int64_t j = 0; j < n; ++j) {
    const float p = y[j] * w;
    o[j] = o[j] + p;
  }
}

// r = o + (p - o) * share over n values (float32 or bf16 in, float32 or bf16 out), each step rounded
// to float32 as torch's ops on float32 tensors round it.
template <typename In, typename Out>
__attribute__((optimize("fp-contract=off"))) inline void merge_row(const In* o, const In* p, float share, Out* r, int64_t n) {
  _Pragma("omp simd") for (int64_t j = 0; j < n; ++j) {
    const float own = load(o, j);
    const float d = load(p, j) - own;
    const float m = d * share;
    put(r, j, own + m);
  }
}

bool use_avx512() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return tm_isa::allows(tm_isa::kCapAvx512) && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
#else
  return false;
#endif
}

bool use_avx2() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return tm_isa::allows(tm_isa::kCapAvx2) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
#else
  return false;
#endif
}

// The row kernels' variant for this CPU: 2 AVX-512, 1 AVX2 (a CPU without AVX-512 ran the baseline
// SSE2 loops: silu_mul 12 us a decode row of 1,536, 29 % of a Q4_K_M token's non-linear time).
int row_isa() { return use_avx512() ? 2 : use_avx2() ? 1 : 0; }

// One token's K or V for one KV head (n values) into row `row` of a cache in `format`.
template <typename In>
TF_INLINE void store_cache_row(bool wide, tm_kv::CacheFormat format, const In* src, void* cache, int64_t row,
                               int64_t n) {
  switch (format) {
    case tm_kv::kCacheF32:
      if (wide) convert_avx512(src, static_cast<float*>(cache) + row * n, n);
      else convert_base(src, static_cast<float*>(cache) + row * n, n);
      break;
    case tm_kv::kCacheBf16:
      if (wide) convert_avx512(src, static_cast<uint16_t*>(cache) + row * n, n);
      else convert_base(src, static_cast<uint16_t*>(cache) + row * n, n);
      break;
    case tm_kv::kCacheInt8: {
      int8_t* dst = static_cast<int8_t*>(cache) + row * tm_kv::row_width(format, n);
      if (tm_kv::rotates(n)) {  // the codes of H x (kv_rotation.h)
        alignas(64) float x[256];
        if (wide) convert_avx512(src, x, n);
        else convert_base(src, x, n);
        tm_kv::rotate(x, n, wide);
        if (wide) quantize_row_avx512(static_cast<const float*>(x), dst, n);
        else quantize_row_base(static_cast<const float*>(x), dst, n);
      } else if (wide) {
        quantize_row_avx512(src, dst, n);
      } else {
        quantize_row_base(src, dst, n);
      }
      break;
    }
  }
}

// One int8 cache row (n values) as bf16 values in dst: code x scale, H x rotated back to x where
// `unrotate` (H is its own inverse: kv_rotation.h), rounded to nearest even once. `x`: n floats.
TF_INLINE void int8_row_values(bool wide, const int8_t* row, int64_t n, bool unrotate, float* x, uint16_t* dst) {
  if (wide) int8_values_avx512(row, x, n);
  else int8_values_base(row, x, n);
  if (unrotate) tm_kv::rotate(x, n, wide);
  if (wide) convert_avx512(static_cast<const float*>(x), dst, n);
  else convert_base(static_cast<const float*>(x), dst, n);
}

}  // namespace
}  // namespace tm_fused
