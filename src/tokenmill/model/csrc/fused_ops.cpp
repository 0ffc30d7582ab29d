// Fused elementwise steps of a decoder layer for the fast path, one call each instead of several
// PyTorch ops: at batch 1 a decode step is ~20 tiny ops per layer, and their per-op overhead costs
// as much as reading the layer's quantized weights (docs/benchmarks.md).
//
//   rope_qk(qkv, cos, sin, nq, nkv) -> (q, k): RoPE (HF's rotate_half form) on the q and k heads of
//       a fused q/k/v projection, written to contiguous [T, heads, head_dim] tensors.
//   rope_store(qkv, cos, sin, nq, nkv, k_cache, v_cache, slots) -> q: the same, but k (roped) and v
//       go straight to their cache slots (fp32 caches [kv_heads, slots, head_dim]).
//   silu_mul(gate_up) -> silu(gate) * up, for gate_up = [gate | up] along the last dim.
//   add_rms_norm_(x, delta, w, eps) -> x += delta (in place), then returns RMSNorm(x) * w.
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
#include <torch/library.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <tuple>

namespace {

#define TF_INLINE inline __attribute__((always_inline))

// exp(x) for x <= 0, Cephes-style polynomial, relative error ~1e-7; branch-free so that it
// vectorises (the same approximation as paged_attention.cpp's softmax).
TF_INLINE float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float shifter = 12582912.0f;
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

// fp32 -> bf16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN. Branch-free
// so that it vectorises.
TF_INLINE uint16_t to_bf16(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? ((b >> 16) | 0x40u) : rounded);
}

#define TF_DEFINE_VARIANT(SUFFIX, ATTR)                                                              \
  ATTR void rope_rows_##SUFFIX(const float* qkv, int64_t row_stride, const float* cos, const float* sin, \
                               int64_t nq, int64_t nkv, int64_t d, float* q, float* k, int64_t t0,    \
                               int64_t t1) {                                                        \
    const int64_t half = d / 2;                                                                      \
    for (int64_t t = t0; t < t1; ++t) {                                                              \
      const float* c = cos + t * d;                                                                  \
      const float* s = sin + t * d;                                                                  \
      for (int64_t h = 0; h < nq + nkv; ++h) {                                                       \
        const float* x = qkv + t * row_stride + h * d;                                               \
        float* o = h < nq ? q + (t * nq + h) * d : k + (t * nkv + h - nq) * d;                       \
        _Pragma("omp simd") for (int64_t i = 0; i < half; ++i) {                                     \
          o[i] = x[i] * c[i] - x[i + half] * s[i];                                                   \
          o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];                              \
        }                                                                                            \
      }                                                                                              \
    }                                                                                                \
  }                                                                                                  \
  ATTR void silu_mul_rows_##SUFFIX(const float* gu, int64_t inter, float* out, int64_t t0, int64_t t1) { \
    for (int64_t t = t0; t < t1; ++t) {                                                              \
      const float* g = gu + t * 2 * inter;                                                           \
      const float* u = g + inter;                                                                    \
      float* o = out + t * inter;                                                                    \
      _Pragma("omp simd") for (int64_t i = 0; i < inter; ++i) {                                      \
        const float x = g[i];                                                                        \
        const float e = exp_nonpos(x > 0.f ? -x : x);                                                \
        const float sig = x > 0.f ? 1.f / (1.f + e) : e / (1.f + e);                                 \
        o[i] = x * sig * u[i];                                                                       \
      }                                                                                              \
    }                                                                                                \
  }                                                                                                  \
  ATTR void add_rms_norm_rows_##SUFFIX(float* x, const float* delta, const float* w, int64_t hidden,  \
                                       float eps, float* out, int64_t t0, int64_t t1) {             \
    for (int64_t t = t0; t < t1; ++t) {                                                              \
      float* xr = x + t * hidden;                                                                    \
      const float* dr = delta + t * hidden;                                                          \
      float ss = 0.f;                                                                                \
      _Pragma("omp simd reduction(+ : ss)") for (int64_t i = 0; i < hidden; ++i) {                   \
        const float v = xr[i] + dr[i];                                                               \
        xr[i] = v;                                                                                   \
        ss += v * v;                                                                                 \
      }                                                                                              \
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);                      \
      float* o = out + t * hidden;                                                                   \
      _Pragma("omp simd") for (int64_t i = 0; i < hidden; ++i) o[i] = w[i] * (xr[i] * inv);          \
    }                                                                                                \
  }

#define TF_DEFINE_STORE(SUFFIX, ATTR)                                                                 \
  ATTR void store_bf16_##SUFFIX(const float* src, uint16_t* dst, int64_t n) {                          \
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);                     \
  }

TF_DEFINE_STORE(base, )
TF_DEFINE_STORE(avx512, __attribute__((target("arch=x86-64-v4,prefer-vector-width=512"))))

TF_DEFINE_VARIANT(base, )
TF_DEFINE_VARIANT(avx512, __attribute__((target("arch=x86-64-v4,prefer-vector-width=512"))))

bool use_avx512() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
#else
  return false;
#endif
}

// Rows per thread chunk: below this many rows everything runs on the calling thread.
constexpr int64_t kRowGrain = 16;

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, name,
              " must be a float32 [rows, n] tensor with contiguous rows");
}

std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                           int64_t nq, int64_t nkv) {
  check_float_rows(qkv, "qkv");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t T = qkv.size(0), d = cos.size(-1);
  TORCH_CHECK(d % 2 == 0 && cos.numel() == T * d && sin.numel() == T * d, "cos and sin must be [T, head_dim]");
  TORCH_CHECK(qkv.size(1) >= (nq + nkv) * d, "qkv has fewer columns than the q and k heads need");
  at::Tensor q = at::empty({T, nq, d}, qkv.options());
  at::Tensor k = at::empty({T, nkv, d}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  const bool wide = use_avx512();
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    if (wide) rope_rows_avx512(src, stride, c, s, nq, nkv, d, qp, kp, t0, t1);
    else rope_rows_base(src, stride, c, s, nq, nkv, d, qp, kp, t0, t1);
  });
  return {q, k};
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t nq, int64_t nkv,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots_in) {
  auto [q, k] = rope_qk(qkv, cos, sin, nq, nkv);
  const int64_t T = qkv.size(0), d = q.size(2);
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK((k_cache.scalar_type() == at::kFloat || bf16) && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == nkv &&
                  k_cache.size(2) == d && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous float32 or bfloat16 [num_kv_heads, slots, head_dim]");
  TORCH_CHECK(qkv.size(1) >= (nq + 2 * nkv) * d, "qkv has fewer columns than q, k and v need");
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "one slot per token");
  const int64_t num_slots = k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool wide = use_avx512();
  const float* kp = k.data_ptr<float>();
  const float* src = qkv.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " is outside the cache");
    for (int64_t h = 0; h < nkv; ++h) {
      const float* ks = kp + (t * nkv + h) * d;
      const float* vs = src + t * qkv.stride(0) + (nq + nkv + h) * d;
      const int64_t at = (h * num_slots + sp[t]) * d;
      if (bf16) {
        uint16_t* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr()) + at;
        uint16_t* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr()) + at;
        if (wide) {
          store_bf16_avx512(ks, kc, d);
          store_bf16_avx512(vs, vc, d);
        } else {
          store_bf16_base(ks, kc, d);
          store_bf16_base(vs, vc, d);
        }
      } else {
        std::memcpy(k_cache.data_ptr<float>() + at, ks, d * sizeof(float));
        std::memcpy(v_cache.data_ptr<float>() + at, vs, d * sizeof(float));
      }
    }
  }
  return q;
}

at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = gate_up_in.contiguous();
  check_float_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  at::Tensor out = at::empty({T, inter}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const bool wide = use_avx512();
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    if (wide) silu_mul_rows_avx512(src, inter, o, t0, t1);
    else silu_mul_rows_base(src, inter, o, t0, t1);
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous float32 [T, hidden]");
  const at::Tensor delta = delta_in.contiguous(), w = w_in.contiguous();
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == at::kFloat, "delta must match x");
  const int64_t T = x.size(0), hidden = x.size(1);
  TORCH_CHECK(w.numel() == hidden && w.scalar_type() == at::kFloat, "weight must be float32 [hidden]");
  at::Tensor out = at::empty(x.sizes(), x.options());
  float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const bool wide = use_avx512();
  at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
    if (wide) add_rms_norm_rows_avx512(xp, dp, wp, hidden, e, o, t0, t1);
    else add_rms_norm_rows_base(xp, dp, wp, hidden, e, o, t0, t1);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenmill_fused, m) {
  m.def("rope_qk(Tensor qkv, Tensor cos, Tensor sin, int nq, int nkv) -> (Tensor, Tensor)", &rope_qk);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, int nq, int nkv, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots) -> Tensor", &rope_store);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor w, float eps) -> Tensor", &add_rms_norm_);
}
