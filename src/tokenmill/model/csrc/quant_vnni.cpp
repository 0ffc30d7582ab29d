// The VNNI quantized-linear ops (the kernel: quant_vnni.h; the formats: quant_blocks.h).

#include "blocked_ops.h"
#include "dense_out.h"
#include "quant_bf16.h"
#include "quant_multiply.h"

namespace {

using namespace tm_vnni;

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                  const at::Tensor& subs, int64_t fmt, int64_t N, int64_t terms, bool amx, bool two_tile_terms) {
  const at::Tensor x = checked_x(x_in, terms, true);
  return multiply(x, {check(codes, scales, mins, subs, fmt, N, x.size(1))}, {0, N / kCols}, terms, amx, false, two_tile_terms);
}

// The same on AMX-BF16 tiles at any row count (tests and benchmarks; `linear` picks by rows).
at::Tensor linear_amx(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                      const at::Tensor& subs, int64_t fmt, int64_t N, bool two_tile_terms) {
  TORCH_CHECK(tm_amx::amx_ready(), "this process cannot run AMX-BF16 tiles");
  const at::Tensor x = checked_x(x_in, 2, true);
  return tm_amx::multiply(x, {check(codes, scales, mins, subs, fmt, N, x.size(1))}, {0, N / kCols}, two_tile_terms);
}

// The same on AVX512-BF16's vector tiles at any row count (tests and benchmarks; `linear` takes them
// from tm_amx::kVecMinRows rows where the CPU has no AMX): Q8_0 only (tm_amx::vec_takes).
at::Tensor linear_vec(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                      const at::Tensor& subs, int64_t fmt, int64_t N) {
  TORCH_CHECK(tm_amx::vec_capable(), "this process cannot run the bf16 vector tiles (no AVX512-BF16)");
  const at::Tensor x = checked_x(x_in, 2, true);
  return tm_amx::multiply_vec(x, {check(codes, scales, mins, subs, fmt, N, x.size(1))}, {0, N / kCols});
}

// silu(x @ gate^T) * (x @ up^T) [M, N / 2] for a gate and up projection stacked in one weight (N rows,
// the gate's first) on AMX-BF16 tiles, the product's epilogue (tm_amx::multiply_silu_mul); where
// silu_mul_fuses says so.
at::Tensor linear_silu_mul(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                           const at::Tensor& subs, int64_t fmt, int64_t N) {
  TORCH_CHECK(tm_amx::amx_ready(), "this process cannot run AMX-BF16 tiles");
  const at::Tensor x = checked_x(x_in, 2, true);
  const Weights w = check(codes, scales, mins, subs, fmt, N, x.size(1));
  TORCH_CHECK(N % (2 * kCols) == 0 && tm_amx::glu_fuses(w), "linear_silu_mul: format ", fmt, " with ", x.size(1),
              " inputs and ", N, " outputs does not fuse");
  return tm_amx::multiply_silu_mul(x, w, N);
}

// Whether linear_silu_mul takes a weight of format fmt, N outputs (gate and up) and K inputs.
bool silu_mul_fuses(int64_t fmt, int64_t N, int64_t K) {
  if (!vnni_supported() || !tm_amx::amx_ready() || K % kGroup != 0 || N % (2 * kCols) != 0) return false;
  Weights w{};
  w.fmt = static_cast<int>(fmt);
  w.G = K / kGroup;
  return tm_amx::glu_fuses(w);
}

// Whether the AMX-BF16 tiles take a bfloat16 x of this weight as it is (its own hi term: one term, no
// mins; quant_amx_calls.h `needs_of`), or without AMX the vector tiles (Q8_0; quant_bf16_vec.h), so
// that a caller holding bf16 activations converts nothing.
bool tiles_take_bf16(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& subs,
                     int64_t fmt, int64_t N, int64_t K, bool two_tile_terms) {
  if (!vnni_supported()) return false;
  const Weights w = check(codes, scales, mins, subs, fmt, N, K);
  if (!tm_amx::amx_ready()) return tm_amx::vec_ready() && !two_tile_terms && tm_amx::vec_takes(w);
  const tm_amx::SplitNeeds needs = tm_amx::needs_of(w, two_tile_terms);
  return !needs.lo && !needs.sums;
}

// The same on AMX-INT8 tiles (tests and benchmarks; `linear` picks by rows and format): 1 to
// tm_amx::kAmxMinRows + 16 rows of a format that folds (quant_amx8.h).
at::Tensor linear_amx8(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                       const at::Tensor& subs, int64_t fmt, int64_t N) {
  TORCH_CHECK(tm_amx8::ready(), "this process cannot run AMX-INT8 tiles");
  TORCH_CHECK(tm_amx8::folds(fmt), "AMX-INT8 tiles: format ", fmt, " does not fold its sub-block scales");
  const at::Tensor x = checked_x(x_in, 2);
  return multiply(x, {check(codes, scales, mins, subs, fmt, N, x.size(1))}, {0, N / kCols}, 2, true, true);
}

// Several weights over the same x, outputs side by side in one y [M, sum N] (a fused q/k/v whose parts a
// GGUF mix stores in different formats: Q4_K_M's q / k in Q4_K and v in Q6_K). x is rounded once
// and each part's blocks write their columns in place: one call instead of a call per part, the
// rounding of each (30 us at 48 rows of K = 1536) and a concatenation of their outputs after.
at::Tensor linear_parts(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef fmts, at::IntArrayRef Ns,
                        int64_t terms, bool amx) {
  const at::Tensor x = checked_x(x_in, terms, true);
  const Parts parts = parts_of(weights, fmts, Ns, x.size(1), check);
  return multiply(x, parts.w, parts.block0, terms, amx);
}

// The fp32 values of one block and group: scale * (code - offset) + min, rounded once as gguf-py
// rounds (scale * code is exact wherever there is a min, so the fused multiply-add is gguf's product
// then sum). sink(j, part, v) takes quad j's columns 4 part .. 4 part + 3: lane 4 c + e of v is column
// 4 part + c at input 4 j + e of the group.
template <class D, class Sink>
TV_TARGET TV_INLINE void decode_group(const Weights& w, int64_t nb, int64_t g, Sink&& sink) {
  const uint8_t* p = w.codes + (nb * w.G + g) * D::kBits * 64;
  __m512i q[8];
  pair<D, 0>(p, q[0], q[4]);
  pair<D, 1>(p, q[1], q[5]);
  pair<D, 2>(p, q[2], q[6]);
  pair<D, 3>(p, q[3], q[7]);
  __m512 sc[D::kSubs], mn[D::kSubs];
  D::scales(w, nb, g, sc);
  const bool has_min = D::has_min(w);
  if (has_min) D::mins(w, nb, g, mn);
  const __m512i lane_col = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  for (int j = 0; j < 8; ++j) {
    const int h = D::kSubs == 2 ? j / 4 : 0;
    for (int part = 0; part < 4; ++part) {  // columns 4 part .. 4 part + 3, lane = 4 c + e
      const __m512i idx = _mm512_add_epi32(lane_col, _mm512_set1_epi32(4 * part));
      const __m128i bytes = part == 0 ? _mm512_extracti32x4_epi32(q[j], 0)
                            : part == 1 ? _mm512_extracti32x4_epi32(q[j], 1)
                            : part == 2 ? _mm512_extracti32x4_epi32(q[j], 2) : _mm512_extracti32x4_epi32(q[j], 3);
      const __m512 code = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(D::kOffset)));
      const __m512 s = _mm512_permutexvar_ps(idx, sc[h]);
      sink(j, part, has_min ? _mm512_fmadd_ps(s, code, _mm512_permutexvar_ps(idx, mn[h])) : _mm512_mul_ps(s, code));
    }
  }
}

// Where decode_group's values go: a block's 16 rows of a bf16 matrix (4 columns x 4 inputs: 8 bytes
// per column), or one column's 32 fp32 values (the others are dropped).
struct Bf16Sink {
  uint16_t* o;
  int64_t K;
  TV_TARGET TV_INLINE void operator()(int j, int part, __m512 v) const {
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), tm_bf16::to_bf16(v));
    for (int c = 0; c < 4; ++c) std::memcpy(o + (4 * part + c) * K + 4 * j, &lanes[c], 8);
  }
};

struct RowSink {
  float* o;
  int64_t c;
  TV_TARGET TV_INLINE void operator()(int j, int part, __m512 v) const {
    if (c / 4 != part) return;
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    std::memcpy(o + 4 * j, lanes + 4 * (c % 4), 16);
  }
};

// The whole weight as a dense bf16 [N, K] matrix, for large batches: oneDNN's bf16 GEMM over it
// beats the two-term VNNI kernel from a few hundred rows (model/layers/quantized_linear.py).
template <class D>
TV_TARGET void dequantize_blocks(const Weights& w, int64_t K, int64_t nb0, int64_t nb1, uint16_t* out) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    for (int64_t g = 0; g < w.G; ++g) {
      uint16_t* o = out + nb * kCols * K + g * kGroup;
      decode_group<D>(w, nb, g, Bf16Sink{o, K});
    }
  }
}

void dequantize_bf16_to(const Weights& w, int64_t N, int64_t K, at::Tensor& out) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  with_decoder(w.fmt, [&]<class D>() {
    at::parallel_for(0, N / kCols, 1, [&](int64_t b0, int64_t b1) { dequantize_blocks<D>(w, K, b0, b1, o); });
  });
}

at::Tensor dequantize_bf16(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                           const at::Tensor& subs, int64_t fmt, int64_t N, int64_t K) {
  const Weights w = check(codes, scales, mins, subs, fmt, N, K);
  at::Tensor out = at::empty({N, K}, scales.options().dtype(at::kBFloat16));
  dequantize_bf16_to(w, N, K, out);
  return out;
}

// The same into the caller's contiguous bf16 [N, K] buffer (a reused scratch, dense_out.h).
void dequantize_bf16_into(at::Tensor out, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                          const at::Tensor& subs, int64_t fmt, int64_t N, int64_t K) {
  const Weights w = check(codes, scales, mins, subs, fmt, N, K);
  tm_dense::check_dense_out(out, N, K, at::kBFloat16);
  dequantize_bf16_to(w, N, K, out);
}

template <class D>
TV_TARGET void lookup_rows(const Weights& w, int64_t N, int64_t K, const int64_t* ids, int64_t t0, int64_t t1,
                           float* out) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t nb = ids[t] / kCols, c = ids[t] % kCols;
    for (int64_t g = 0; g < w.G; ++g) {
      float* o = out + t * K + g * kGroup;
      decode_group<D>(w, nb, g, RowSink{o, c});
    }
  }
}

// Rows `ids` of the weight as fp32 [T, K] (embedding lookups of a tied, blocked weight).
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                           const at::Tensor& subs, int64_t fmt, int64_t N, int64_t K, const at::Tensor& ids_in) {
  const Weights w = check(codes, scales, mins, subs, fmt, N, K);
  const at::Tensor ids = checked_ids(ids_in, N);
  const int64_t T = ids.numel();
  at::Tensor out = at::empty({T, K}, scales.options().dtype(at::kFloat));
  const int64_t* idp = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  with_decoder(w.fmt, [&]<class D>() {
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) { lookup_rows<D>(w, N, K, idp, t0, t1, o); });
  });
  return out;
}

bool supported() { return vnni_supported(); }
bool amx_supported() { return vnni_supported() && tm_amx::amx_ready(); }
// Whether `linear` runs Q8_0 steps of vec_min_rows()+ rows on the bf16 vector tiles here (no AMX).
bool vec_supported() { return vnni_supported() && tm_amx::vec_ready(); }
// Whether linear_vec runs here at all (AVX512-BF16; AMX CPUs too, where `linear` takes the tiles).
bool vec_capable() { return vnni_supported() && tm_amx::vec_capable(); }
int64_t vec_min_rows() { return tm_amx::kVecMinRows; }
bool amx8_supported() { return vnni_supported() && tm_amx8::ready(); }
int64_t amx_min_rows() { return tm_amx::kAmxMinRows; }

}  // namespace

TORCH_LIBRARY(tokenmill_vnni, m) {
  m.def("linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N, int terms=2, "
        "bool amx=True, bool two_tile_terms=False) -> Tensor",
        &linear);
  m.def("linear_parts(Tensor x, Tensor[] weights, int[] fmts, int[] Ns, int terms=2, bool amx=True) -> Tensor", &linear_parts);
  m.def("dequantize_rows(Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N, int K, Tensor ids) "
        "-> Tensor", &dequantize_rows);
  m.def("dequantize_bf16(Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N, int K) -> Tensor",
        &dequantize_bf16);
  m.def("dequantize_bf16_into(Tensor(a!) out, Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N, "
        "int K) -> ()", &dequantize_bf16_into);
  m.def("linear_amx(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N, "
        "bool two_tile_terms=False) -> Tensor",
        &linear_amx);
  m.def("linear_vec(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N) -> Tensor",
        &linear_vec);
  m.def("linear_amx8(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N) -> Tensor",
        &linear_amx8);
  m.def("linear_silu_mul(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N) -> Tensor",
        &linear_silu_mul);
  m.def("silu_mul_fuses(int fmt, int N, int K) -> bool", &silu_mul_fuses);
  m.def("tiles_take_bf16(Tensor codes, Tensor scales, Tensor mins, Tensor subs, int fmt, int N, int K, "
        "bool two_tile_terms=False) -> bool", &tiles_take_bf16);
  m.def("supported() -> bool", &supported);
  m.def("amx8_supported() -> bool", &amx8_supported);
  m.def("amx_supported() -> bool", &amx_supported);
  m.def("amx_min_rows() -> int", &amx_min_rows);
  m.def("vec_supported() -> bool", &vec_supported);
  m.def("vec_capable() -> bool", &vec_capable);
  m.def("vec_min_rows() -> int", &vec_min_rows);
}
