#pragma once
// The kernels a fused decode step calls, one kit per instruction set: AVX512-VNNI and AVX2.
//
// Why: the step's phases (decode_phases.h, decode_row_phases.h, decode_step_moe.h) and each family's
// sequence of them are the same on every CPU; what differs is which kernel multiplies a blocked
// weight (quant_vnni.h or quant_avx2.h), how activations are rounded for it (the same layout and
// numbers, different instructions), and which variant of the elementwise ops and of attention runs.
// Without an AVX2 kit a CPU without AVX-512 ran its decode steps op by op: ~120 kernel calls a token,
// each a Python call and an OpenMP fork. The phases are templates on a kit; a stack is built for one
// kit (model/fused_decode.py passes quant_kernel.blocked_kernel()'s choice, so the step runs the
// kernel the op-by-op path runs) and its `run` instantiates the phases with it.
//
// A kit has only static members: blocks (a weight's column blocks x rows), quantize_rows and
// quantize_span (activations rounded into the kernel's layout), dot (the MoE router), add_rms_norm,
// rope, silu_mul, store_row (a K or V row into a cache), isa / attention (the attention variant and
// the plan's lanes).
//
// Needs fused_ops.h, paged_attention.h, quant_vnni.h, quant_amx.h, quant_amx8.h, quant_bf16_vec.h and quant_avx2.h included
// first.

#include <immintrin.h>

#include <cstdint>

namespace tm_step {

constexpr int64_t kTerms = 2;  // int8 terms per activation (two: near fp32 quality, see quant_vnni.h)

enum KitId : int64_t { kKitAvx512 = 0, kKitAvx2 = 1 };

struct Avx512Kit {
  static constexpr const char* kName = "AVX512-VNNI";
  static constexpr bool kAmxTiles = true;  // steps of many rows on AMX tiles where the CPU has them

  static bool supported() { return tm_fused::use_avx512() && tm_vnni::vnni_supported(); }

  // All of a's rows on the AMX-BF16 tiles where a carries them split (make_scratch: a step of
  // tm_amx::kAmxMinRows+ rows on a CPU with AMX; without AMX, from tm_amx::kVecMinRows rows, Q8_0's
  // vector tiles), or on the AMX-INT8 tiles where a carries them rounded for those and the format
  // folds (a step of tm_amx8::kAmx8MinRows+), the VNNI kernel otherwise (an expert's rows, the other
  // formats).
  static void blocks(const tm_vnni::Weights& w, const tm_vnni::Acts& a, int64_t m0, int64_t m1, int64_t N,
                     int64_t nb0, int64_t nb1, float* y) {
    const bool all = m0 == 0 && m1 == a.M;
    if (a.split.hi != nullptr && all && tm_amx::amx_ready()) tm_amx::blocks(w, a.split, a.M, nb0, nb1, y, N);
    else if (a.split.hi != nullptr && all && tm_amx::vec_takes(w)) tm_amx::vec_blocks(w, a.split, a.M, nb0, nb1, y, N);
#if TM_AMX_COMPILES
    else if (a.amx8.q != nullptr && all && tm_amx8::folds(w.fmt)) tm_amx8::blocks(w, a.amx8, nb0, nb1, y, N);
#endif
    else tm_vnni::blocks<kTerms>(w, a, m0, m1, N, nb0, nb1, y);
  }

  // The rows' int8 terms where a wants them, and their bf16 terms where a carries a split, or their
  // per-256 int8 terms where a carries those (the thread of the last rows zeroes the padding to
  // whole tiles).
  static void quantize_rows(const float* x, int64_t K, int64_t m0, int64_t m1, const tm_vnni::Acts& a) {
    if (a.int8) tm_vnni::quantize_rows<kTerms>(x, K, m0, m1, a);
    if (a.split.hi != nullptr) tm_amx::split_into(x, m0, m1 == a.M ? a.split.Mp : m1, a.M, a.split);
    if (a.amx8.q != nullptr) tm_amx8::quantize_rows(x, m0, m1 == a.M ? a.amx8.Mp : m1, a.amx8);
  }

  // Groups [g0, g1) of row m of a G-group row rounded into a (x: the row's values from group g0), by
  // the calls quantize_rows makes for them when g0 is a multiple of 4.
  TV_TARGET static void quantize_span(const float* x, int64_t G, int64_t g0, int64_t g1, int64_t m,
                                      const tm_vnni::Acts& a) {
    using tm_vnni::kGroup;
    const int64_t M = a.M;
    for (int64_t g = g0; g < g1;) {
      const int64_t at = g * M + m;
      const tm_vnni::GroupOut o{a.xq + at * kTerms * kGroup, a.dx + at * kTerms, a.qsum + at,
                                a.msum + at * tm_vnni::kMergedSums, a.hqsum + at * 2};
      const float* src = x + (g - g0) * kGroup;
      if (g + 4 <= G) {
        tm_vnni::quantize4<kTerms>(src, o, M);
        g += 4;
      } else {
        tm_vnni::quantize1(_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16), kTerms, o);
        g += 1;
      }
    }
  }

  // fp32 dot product in 16 lanes (the router: E of these per token and layer).
  TV_TARGET static float dot(const float* a, const float* b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float sum = _mm512_reduce_add_ps(acc);
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
  }

  static void add_rms_norm(float* x, const float* delta, const float* w, int64_t hidden, float eps, float* out,
                           int64_t t0, int64_t t1) {
    tm_fused::add_rms_norm_rows_avx512(x, delta, w, hidden, eps, out, t0, t1);
  }

  static void rope(const float* qkv, int64_t stride, const float* cos, const float* sin, int64_t nq, int64_t nkv,
                   int64_t d, float* q, float* k, int64_t t0, int64_t t1) {
    tm_fused::rope_rows_avx512(qkv, stride, cos, sin, nq, nkv, d, q, k, t0, t1);
  }

  static void silu_mul(const float* gu, int64_t n, float* o, int64_t t0, int64_t t1) {
    tm_fused::silu_mul_rows_avx512(gu, n, o, t0, t1);
  }

  static void store_row(tm_kv::CacheFormat format, const float* src, void* cache, int64_t row, int64_t n) {
    tm_fused::store_cache_row(true, format, src, cache, row, n);
  }

  static tm_attention::Isa isa() { return tm_attention::selected_isa(-1); }

  // An AVX-512 variant (bf16 pair products where the CPU has AVX512-BF16), the op's own choice.
  static tm_attention::RangeFn attention(tm_kv::CacheFormat format) {
    return tm_attention::pick_avx512(isa(), format);
  }
};

struct Avx2Kit {
  static constexpr const char* kName = "AVX2";
  static constexpr bool kAmxTiles = false;

  static bool supported() { return tm_fused::use_avx2() && tm_avx2::avx2_supported(); }

  static void blocks(const tm_vnni::Weights& w, const tm_vnni::Acts& a, int64_t m0, int64_t m1, int64_t N,
                     int64_t nb0, int64_t nb1, float* y) {
    tm_avx2::blocks<kTerms>(w, a, m0, m1, N, nb0, nb1, y);
  }

  static void quantize_rows(const float* x, int64_t K, int64_t m0, int64_t m1, const tm_vnni::Acts& a) {
    tm_avx2::round_rows<kTerms>(x, K, m0, m1, a);
  }

  // The AVX2 rounding is one group at a time, so a span is its groups' calls whatever G is.
  static void quantize_span(const float* x, int64_t /*G*/, int64_t g0, int64_t g1, int64_t m,
                            const tm_vnni::Acts& a) {
    tm_avx2::round_span<kTerms>(x, g0, g1, m, a);
  }

  T2_TARGET static float dot(const float* a, const float* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float sum = _mm_cvtss_f32(s);
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
  }

  static void add_rms_norm(float* x, const float* delta, const float* w, int64_t hidden, float eps, float* out,
                           int64_t t0, int64_t t1) {
    tm_fused::add_rms_norm_rows_avx2(x, delta, w, hidden, eps, out, t0, t1);
  }

  static void rope(const float* qkv, int64_t stride, const float* cos, const float* sin, int64_t nq, int64_t nkv,
                   int64_t d, float* q, float* k, int64_t t0, int64_t t1) {
    tm_fused::rope_rows_avx2(qkv, stride, cos, sin, nq, nkv, d, q, k, t0, t1);
  }

  static void silu_mul(const float* gu, int64_t n, float* o, int64_t t0, int64_t t1) {
    tm_fused::silu_mul_rows_avx2(gu, n, o, t0, t1);
  }

  // The op-by-op store's choice on such a CPU (fused_ops.cpp: the AVX-512 loops or the baseline's).
  static void store_row(tm_kv::CacheFormat format, const float* src, void* cache, int64_t row, int64_t n) {
    tm_fused::store_cache_row(false, format, src, cache, row, n);
  }

  static tm_attention::Isa isa() { return tm_attention::kAvx2; }

  static tm_attention::RangeFn attention(tm_kv::CacheFormat format) { return tm_attention::avx2_fns[format]; }
};

// Calls f.template operator()<Kit>() with the kit `id` names (a stack's `run`).
template <class F>
inline auto with_kit(int64_t id, F&& f) {
  if (id == kKitAvx2) return f.template operator()<Avx2Kit>();
  return f.template operator()<Avx512Kit>();
}

// Whether the kit `id` names exists and runs on this CPU (TOKENMILL_CPU_ISA's cap included).
inline bool kit_supported(int64_t id) {
  if (id == kKitAvx512) return Avx512Kit::supported();
  if (id == kKitAvx2) return Avx2Kit::supported();
  return false;
}

}  // namespace tm_step
