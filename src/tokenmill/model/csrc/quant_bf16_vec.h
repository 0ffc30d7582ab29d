#pragma once
// The AMX-BF16 tiles' one-term products (quant_amx.h) on AVX512-BF16's vector dot products, for steps of
// many rows on CPUs with bf16 dot products and no AMX (AMD Zen 4 and 5): Q8_0 prompts.
//
// Why: there a prompt step's Q8_0 layers ran the VNNI kernel's two int8 terms, 16 vpdpbusd a group,
// row and column block, on the two pipes that also run every fp32 FMA: a 512-row step of SmolLM2's
// gate / up (3,072 x 576) took 5-6.5 ms on Zen 4, oneDNN's bf16 GEMM over the dequantized weights
// ~4.4, and the VNNI kernel's one term (int8 activations, llama.cpp's) 3-3.7 at a quality no format
// keeps (top-1 97.2 % against exact on the Q8_0 mix). A Q8_0 code is an integer bf16 holds exactly, so
// bf16(x) times the codes, summed in fp32 per group and scaled by the group's fp32 scale, rounds
// nothing but the activations' 8 bits: the AMX tiles' one-term arithmetic (kTerms), which kept the
// quality bound, at 16 vdpbf16ps a group, row and block (each 2 inputs x 16 columns) instead of 16
// vpdpbusd plus the terms' merge and scaling. docs/benchmarks.md, "Q8_0 prompts on AVX512-BF16".
//
// Layout: the AMX path's own. The weights are decoded a chunk of column blocks at a time into AMX's B
// layout (decode_block: per group 16 rows of 16 columns x 2 consecutive inputs, each row one zmm of
// 32 bf16, which is vdpbf16ps's operand as it is), the rows split into bf16 hi (split_rows). A tile
// is kVecRows rows x two column blocks: per group, each B row loaded once serves kVecRows products, each
// pair of a row's inputs broadcast from memory two.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include "quant_amx_calls.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tm_amx {

// From how many rows steps whose weights all take these products (vec_takes) run them instead of the
// VNNI kernel's two terms (docs/benchmarks.md, "Q8_0 prompts on AVX512-BF16").
constexpr int64_t kVecMinRows = 64;
// Rows a vector tile (of two column blocks: 24 sums and accumulators in registers, two B rows and a
// broadcast).
constexpr int64_t kVecRows = 6;
// Bytes of decoded B a chunk: every row tile runs over the whole chunk, which stays in L2 beside the
// tile's rows (Zen 4: 1 MB of L2 a core; the AMX path's 1 MB chunks measured slower here).
constexpr int64_t kVecChunkBytes = 256 * 1024;

#if TM_AMX_COMPILES

// Whether this process can run these products: bf16 dot products, and AVX-512 allowed.
inline bool vec_capable() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return tm_isa::allows(tm_isa::kCapAvx512) && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  }();
  return yes;
}

// Whether steps take them: capable, and no AMX tiles (where the tiles run, they take the same steps).
inline bool vec_ready() { return vec_capable() && !amx_ready(); }

// The formats these products take: units of 32 inputs, one plane of exact codes, one activation term
// and no mins (Q8_0).
template <class D>
constexpr bool kVecFormat = kUnitInputs<D> == kGroup && kPlanes<D> == 1 && kTerms<D> == 1 && !kFolds<D> &&
                            !kFoldsScale<D>;

inline bool vec_takes(const Weights& w) {
  bool takes = false;
  tm_vnni::with_decoder(w.fmt, [&]<class D>() { takes = kVecFormat<D> && !D::has_min(w); });
  return takes;
}

inline bool vec_takes(const std::vector<Weights>& w) {
  return std::all_of(w.begin(), w.end(), [](const Weights& wi) { return vec_takes(wi); });
}

// A pair of bf16 inputs as one 32-bit lane, broadcast (folded into vdpbf16ps's memory operand).
TA_TARGET TA_INLINE __m512bh pair_of(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}

// R rows (hi: the first one's, K apart; rows past `rows` read the last real one again) x NB column blocks (b, sc, y:
// block j's at b + j * b_stride, sc + j * s_stride, y + j * kCols) over `units` groups of a span: the
// rows' sums into y (only its `rows` real ones), or added to it (`add`). b, sc: the span's
// decode_block output (sc one record of 16 column scales a group). Per group, each B row loaded once
// serves its R products, each broadcast pair of inputs NB.
template <int R, int NB>
TA_TARGET void vec_tile(const uint16_t* hi, int64_t K, int64_t rows, int64_t units, const uint16_t* b, int64_t b_stride,
                        const float* sc, int64_t s_stride, float* y, int64_t ldy, bool add) {
  __m512 acc[R * NB];
#pragma GCC unroll 16
  for (int t = 0; t < R * NB; ++t) {
    const int r = t / NB, j = t % NB;
    acc[t] = add && r < rows ? _mm512_loadu_ps(y + r * ldy + j * kCols) : _mm512_setzero_ps();
  }
  const uint16_t* row[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) row[r] = hi + std::min<int64_t>(r, rows - 1) * K;
  for (int64_t u = 0; u < units; ++u) {
    __m512 c[R * NB];
#pragma GCC unroll 16
    for (int t = 0; t < R * NB; ++t) c[t] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int p = 0; p < kGroup / 2; ++p) {
      __m512bh w[NB];
#pragma GCC unroll 2
      for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(b + j * b_stride + u * 512 + 32 * p);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh xr = pair_of(row[r] + u * kGroup + 2 * p);
#pragma GCC unroll 2
        for (int j = 0; j < NB; ++j) c[r * NB + j] = _mm512_dpbf16_ps(c[r * NB + j], xr, w[j]);
      }
    }
#pragma GCC unroll 2
    for (int j = 0; j < NB; ++j) {
      const __m512 s = _mm512_loadu_ps(sc + j * s_stride + u * kCols);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r * NB + j] = _mm512_fmadd_ps(c[r * NB + j], s, acc[r * NB + j]);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(y + r * ldy + j * kCols, acc[r * NB + j]);
}

// Blocks nb0..nb1 of one weight x all M rows of a, into y's columns (ldy = y's row length): the
// chunks and spans of the AMX path (blocks_of), each chunk decoded once and every row tile run over it.
template <class D>
TA_TARGET void vec_blocks_of(const Weights& w, const SplitActs& a, int64_t M, int64_t nb0, int64_t nb1, float* y,
                             int64_t ldy) {
  if constexpr (!kVecFormat<D>) {
    TORCH_CHECK(false, "bf16 vector tiles: format ", w.fmt, " does not run on them");
  } else {
    if (nb1 <= nb0) return;
    const int64_t span = span_groups(w.G), block_b = span * 512, block_bytes = 2 * block_b + 2 * span * kCols * 4;
    const int64_t most = std::max<int64_t>(1, kVecChunkBytes / block_bytes), blocks = nb1 - nb0;
    const int64_t chunk = (blocks + (blocks + most - 1) / most - 1) / ((blocks + most - 1) / most);  // even chunks
    thread_local std::vector<uint16_t> bbuf;
    thread_local std::vector<float> sbuf;
    bbuf.resize(static_cast<size_t>(chunk * block_b));
    sbuf.resize(static_cast<size_t>(chunk * 2 * span * kCols));
    for (int64_t c0 = nb0; c0 < nb1; c0 += chunk) {
      const int64_t c1 = std::min(nb1, c0 + chunk);
      for (int64_t g0 = 0; g0 < w.G; g0 += span) {
        const int64_t g1 = std::min(w.G, g0 + span);
        for (int64_t nb = c0; nb < c1; ++nb) {
          float* s = sbuf.data() + (nb - c0) * 2 * span * kCols;
          decode_block<D>(w, nb, g0, g1, bbuf.data() + (nb - c0) * block_b, s, s + span * kCols);
        }
        const int64_t s_stride = 2 * span * kCols;
        for (int64_t m0 = 0; m0 < M; m0 += kVecRows) {
          const int64_t rows = std::min(kVecRows, M - m0);
          const uint16_t* x0 = a.hi + m0 * a.K + g0 * kGroup;
          int64_t nb = c0;
          for (; nb + 1 < c1; nb += 2)  // two blocks a tile: each broadcast pair serves two products
            vec_tile<kVecRows, 2>(x0, a.K, rows, g1 - g0, bbuf.data() + (nb - c0) * block_b, block_b,
                                  sbuf.data() + (nb - c0) * s_stride, s_stride, y + m0 * ldy + nb * kCols, ldy, g0 > 0);
          if (nb < c1)
            vec_tile<kVecRows, 1>(x0, a.K, rows, g1 - g0, bbuf.data() + (nb - c0) * block_b, block_b,
                                  sbuf.data() + (nb - c0) * s_stride, s_stride, y + m0 * ldy + nb * kCols, ldy, g0 > 0);
        }
      }
    }
  }
}

// vec_blocks_of for w's format (vec_takes(w); the fused step's kit, decode_kits.h).
inline void vec_blocks(const Weights& w, const SplitActs& a, int64_t M, int64_t nb0, int64_t nb1, float* y, int64_t ldy) {
  tm_vnni::with_decoder(w.fmt, [&]<class D>() { vec_blocks_of<D>(w, a, M, nb0, nb1, y, ldy); });
}

// y [M, N] = x @ W^T for weights side by side (quant_vnni.cpp `multiply`'s parts; vec_takes(w)), on the
// vector tiles: x's rows split once into bf16, the column blocks shared between the threads.
inline at::Tensor multiply_vec(const at::Tensor& x, const std::vector<Weights>& w, const std::vector<int64_t>& block0) {
  for (const Weights& wi : w)
    TORCH_CHECK(vec_takes(wi), "bf16 vector tiles: format ", wi.fmt, " does not run on them (Q8_0 only)");
  const int64_t M = x.size(0), nblocks = block0.back(), N = nblocks * kCols;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  at::Tensor scratch;
  const SplitActs a = split_rows(x, scratch, SplitNeeds{false, false});
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (size_t i = 0; i < w.size(); ++i) {
      const int64_t lo = std::max(b0, block0[i]), hi = std::min(b1, block0[i + 1]);
      if (lo >= hi) continue;
      vec_blocks(w[i], a, M, lo - block0[i], hi - block0[i], yp + block0[i] * kCols, N);
    }
  });
  return y;
}

#else
inline bool vec_capable() { return false; }
inline bool vec_ready() { return false; }
inline bool vec_takes(const Weights&) { return false; }
inline bool vec_takes(const std::vector<Weights>&) { return false; }
inline void vec_blocks(const Weights&, const SplitActs&, int64_t, int64_t, int64_t, float*, int64_t) {}
inline at::Tensor multiply_vec(const at::Tensor&, const std::vector<Weights>&, const std::vector<int64_t>&) {
  TORCH_CHECK(false, "bf16 vector tiles: not built with this compiler");
}
#endif  // TM_AMX_COMPILES

}  // namespace tm_amx
