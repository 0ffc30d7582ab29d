#pragma once
// The column-blocked quantized linear (quant_vnni.h's layout and formats) on CPUs with AVX2 but no
// AVX512-VNNI: y[M, N] = x[M, K] @ W^T, and the weight's values (fp32) for prompt GEMMs and lookups.
//
// Why: most CPUs people run models on have no AVX-512 (Intel client chips since Alder Lake, AMD before
// Zen 4). Without this file every K-quant, Q5 and IQ4 tensor of a GGUF ran there dequantized to bf16
// (3.5x a Q4_K_M file's bytes, and a bf16 GEMM those CPUs emulate at a fifth of their fp32 speed).
//
// Same layout, same formats: a 64-byte quad of the blocked layout (4 inputs x 16 columns) is two
// 32-byte halves here, columns 0..7 and 8..15, and each half runs as its own block of 8 columns (the
// unpacking of every format is byte-wise, so a half unpacks as the whole does). What a format is
// (bits, sub-blocks, offset, codebook, where its scales lie) is its decoder's in quant_blocks.h; this
// file reads those traits and unpacks by bit width and scale kind, so a new decoder needs nothing here
// unless it brings a new width or scale kind.
//
// AVX2 has no vpdpbusd: an unsigned-by-signed byte product is vpmaddubsw (pairs summed into int16,
// saturating) then vpmaddwd by ones (int32). Codes of at most 6 bits times activations of at most 127
// cannot saturate, and kChain quads' int16 sums are added before the widening (4-bit: a group's 8).
// Formats whose codes are stored + 128 (Q8_0, and the codebooks IQ4 / MXFP4) would saturate; they run
// signed (llama.cpp's way): |code - 128| times the activation carrying the code's sign. For that
// the activations' second term is clamped to [-127, 127] here (quant_acts.h allows -128), one fine step
// at most, the same bound as its saturation at +128.

#include <immintrin.h>

#include "blocked_weights.h"
#include "cpu_isa_cap.h"
#include "quant_acts.h"
#include "quant_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tm_avx2 {

using tm_vnni::kCols;
using tm_vnni::kGroup;
using tm_vnni::kMergedSums;
using tm_vnni::Weights;

#define TA_TARGET __attribute__((target("avx2,fma,f16c")))
#define TA_INLINE inline __attribute__((always_inline))

constexpr int kHalf = 8;  // columns of a half block

bool avx2_supported() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return tm_isa::allows(tm_isa::kCapAvx2) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return yes;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------------
// Codes of one half block (p points at the group's codes + 32 * half): quads J and J + 4 of the
// half's 8 columns, byte 4 c + e = column c, input 4 J + e (quant_blocks.h pair_codes, per 32 bytes).

template <int S>
TA_TARGET TA_INLINE __m256i shift(__m256i v) {  // left by S, right by -S (16-bit lanes)
  if constexpr (S > 0) return _mm256_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
  else return v;
}

TA_TARGET TA_INLINE __m256i or_masked(__m256i a, __m256i b, __m256i mask) {
  return _mm256_or_si256(a, _mm256_and_si256(b, mask));
}

TA_TARGET TA_INLINE __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

template <int Bits, int J>
TA_TARGET TA_INLINE void pair_codes(const uint8_t* p, __m256i& lo, __m256i& hi) {
  if constexpr (Bits == 8) {
    lo = load32(p + J * 64);
    hi = load32(p + (J + 4) * 64);
  } else if constexpr (Bits == 1) {
    const __m256i two = _mm256_set1_epi8(0x02), v = load32(p);
    lo = _mm256_and_si256(shift<1 - J>(v), two);
    hi = _mm256_and_si256(shift<1 - (J + 4)>(v), two);
  } else if constexpr (Bits == 2 || Bits == 3) {
    const __m256i three = _mm256_set1_epi8(0x03), v = load32(p + (J % 2) * 64);
    lo = _mm256_and_si256(shift<-2 * (J / 2)>(v), three);
    hi = _mm256_and_si256(shift<-2 * (J / 2 + 2)>(v), three);
    if constexpr (Bits == 3) {
      const __m256i bit = _mm256_set1_epi8(0x04), h = load32(p + 128);
      lo = or_masked(lo, shift<2 - J>(h), bit);
      hi = or_masked(hi, shift<2 - (J + 4)>(h), bit);
    }
  } else {
    const __m256i nibble = _mm256_set1_epi8(0x0F), v = load32(p + J * 64);
    lo = _mm256_and_si256(v, nibble);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    if constexpr (Bits == 5) {
      const __m256i bit = _mm256_set1_epi8(0x10), h = load32(p + 256);
      lo = or_masked(lo, shift<4 - J>(h), bit);
      hi = or_masked(hi, shift<-J>(h), bit);
    } else if constexpr (Bits == 6) {
      const __m256i two = _mm256_set1_epi8(0x30), h = load32(p + 256 + (J % 2) * 64);
      lo = or_masked(lo, shift<4 - 2 * (J / 2)>(h), two);
      hi = or_masked(hi, shift<-2 * (J / 2)>(h), two);
    }
  }
}

// The decoder's codebook (quant_blocks.h, + 128) in both 128-bit lanes, for vpshufb.
template <class D>
TA_TARGET TA_INLINE __m256i codebook() {
  if constexpr (D::kFmt == tm_vnni::kMXFP4)
    return _mm256_setr_epi8(-128, -127, -126, -125, -124, -122, -120, -116, -128, 127, 126, 125, 124, 122, 120, 116,
                            -128, -127, -126, -125, -124, -122, -120, -116, -128, 127, 126, 125, 124, 122, 120, 116);
  else
    return _mm256_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59, -39, -15,
                            1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59, -39, -15);
}

// The 8 quads of a group's half block, quad j in q[j] (codes + kOffset, unsigned).
template <class D>
TA_TARGET TA_INLINE void group_codes(const uint8_t* p, __m256i (&q)[8]) {
  pair_codes<D::kBits, 0>(p, q[0], q[4]);
  pair_codes<D::kBits, 1>(p, q[1], q[5]);
  pair_codes<D::kBits, 2>(p, q[2], q[6]);
  pair_codes<D::kBits, 3>(p, q[3], q[7]);
  if constexpr (D::kCodebook) {
    const __m256i table = codebook<D>();
    for (int j = 0; j < 8; ++j) q[j] = _mm256_shuffle_epi8(table, q[j]);
  }
}

// ---------------------------------------------------------------------------------------------
// Scales and mins of a half block's 8 columns, per sub-block (the decoders' records, quant_blocks.h).

TA_TARGET TA_INLINE __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
TA_TARGET TA_INLINE __m256i load_u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
TA_TARGET TA_INLINE __m256 neg(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.f)); }

template <class D>
TA_TARGET TA_INLINE void scales(const Weights& w, int64_t nb, int64_t g, int half, __m256 (&sc)[D::kSubs]) {
  using tm_vnni::Sub;
  if constexpr (D::kFmt == tm_vnni::kMXFP4) {  // 2^(e - 128) in the exponent field, e = 0 / 1 subnormal
    const __m256i e = load_u8x8(w.subs + (nb * w.G + g) * kCols + kHalf * half);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    sc[0] = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
  } else if constexpr (tm_vnni::fmt_super(D::kFmt)) {
    const __m256 d = load_half8(w.scales + D::at(w, nb, g) + kHalf * half);
    const int j = static_cast<int>(g % tm_vnni::kSuper);
    for (int h = 0; h < D::kSubs; ++h) {
      const uint8_t* p = D::sub(w, nb, g, D::kSubs * j + h) + kHalf * half;
      __m256i v;
      if constexpr (D::kKind == Sub::kInt8) v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      else if constexpr (D::kKind == Sub::kScaleMin6) v = load_u8x8(p);
      else v = _mm256_and_si256(load_u8x8(p), _mm256_set1_epi32(15));
      sc[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
    }
  } else {
    sc[0] = load_half8(w.scales + D::at(w, nb, g) + kHalf * half);
  }
}

template <class D>
TA_TARGET TA_INLINE void mins(const Weights& w, int64_t nb, int64_t g, int half, __m256 (&mn)[D::kSubs]) {
  using tm_vnni::Sub;
  if constexpr (D::kFmt == tm_vnni::kMXFP4) {
    mn[0] = _mm256_setzero_ps();
  } else if constexpr (tm_vnni::fmt_super(D::kFmt)) {
    const __m256 dmin = load_half8(w.mins + D::at(w, nb, g) + kHalf * half);
    const int j = static_cast<int>(g % tm_vnni::kSuper);
    for (int h = 0; h < D::kSubs; ++h) {
      if constexpr (D::kKind == Sub::kScaleMin6) {
        mn[h] = neg(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(load_u8x8(D::sub(w, nb, g, 8 + j) + kHalf * half))));
      } else {
        const __m256i v = load_u8x8(D::sub(w, nb, g, D::kSubs * j + h) + kHalf * half);
        mn[h] = neg(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4))));
      }
    }
  } else {
    mn[0] = load_half8(w.mins + D::at(w, nb, g) + kHalf * half);
  }
}

// ---------------------------------------------------------------------------------------------
// Activations: quant_acts.h's rounding (same Acts layout and sums), with the second term clamped
// to [-127, 127] (see the top of the file).

TA_TARGET TA_INLINE float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

TA_TARGET TA_INLINE int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// 8 int32 (each within int8) to 8 bytes at dst.
TA_TARGET TA_INLINE void store_i8x8(int8_t* dst, __m256i q) {
  const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packs_epi16(w16, w16));
}

template <int Terms>
TA_TARGET void round_group(const float* src, const tm_vnni::GroupOut& o) {
  __m256 v[4];
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs_mask));
  }
  const float amax = hmax(m);
  float inv_s = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
  float total_sum = 0.f, half_sum[2] = {0.f, 0.f};
  int32_t merged[kMergedSums] = {0, 0, 0};
  for (int t = 0; t < Terms; ++t) {
    if (t > 0) {
      inv_s *= tm_vnni::kFineSteps;
      scale /= tm_vnni::kFineSteps;
    }
    const __m256 inv = _mm256_set1_ps(inv_s), s = _mm256_set1_ps(scale);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      if (t > 0) q[i] = _mm256_min_epi32(_mm256_max_epi32(q[i], _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
      store_i8x8(o.xq + t * kGroup + 8 * i, q[i]);
      v[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[i]), s, v[i]);
    }
    const int32_t first = hsum(_mm256_add_epi32(q[0], q[1])), total = first + hsum(_mm256_add_epi32(q[2], q[3]));
    o.dx[t] = scale;
    total_sum = std::fma(scale, static_cast<float>(total), total_sum);
    half_sum[0] = std::fma(scale, static_cast<float>(first), half_sum[0]);
    half_sum[1] = std::fma(scale, static_cast<float>(total - first), half_sum[1]);
    tm_vnni::merge_term_sums(merged, total, first);
  }
  *o.qsum = total_sum;
  for (int i = 0; i < kMergedSums; ++i) o.msum[i] = merged[i];
  o.hqsum[0] = half_sum[0];
  o.hqsum[1] = half_sum[1];
}

template <int Terms>
TA_TARGET void round_rows(const float* x, int64_t K, int64_t m0, int64_t m1, const tm_vnni::Acts& a) {
  const int64_t G = K / kGroup, M = a.M;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = g * M + m;
      round_group<Terms>(x + m * K + g * kGroup, tm_vnni::GroupOut{a.xq + at * Terms * kGroup, a.dx + at * Terms,
                                                                       a.qsum + at, a.msum + at * kMergedSums,
                                                                       a.hqsum + at * 2});
    }
}

// ---------------------------------------------------------------------------------------------
// The product.

template <class D>
constexpr bool kSigned = D::kOffset == 128;  // codes stored + 128: run as signed bytes

// Quads whose int16 pair sums can be added before widening: |code| * 127 * 2 per vpmaddubsw.
template <class D>
constexpr int chain() {
  constexpr int max_code = kSigned<D> ? 128 : D::kBits == 1 ? 2 : (1 << D::kBits) - 1;
  constexpr int n = 32767 / (max_code * 127 * 2);
  return n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1;
}

TA_TARGET TA_INLINE __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// One (row, term)'s int32 sums over the quads [J0, J0 + Q) of a group, from `start`: u the unsigned
// codes (or |code - 128|), s the codes - 128 whose signs the activations take (signed formats).
template <class D, int Q>
TA_TARGET TA_INLINE __m256i dot(const __m256i* u, const __m256i* s, const int8_t* x, __m256i start) {
  constexpr int kChain = chain<D>() < Q ? chain<D>() : Q;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum = start;
#pragma GCC unroll 8
  for (int j = 0; j < Q; j += kChain) {
    __m256i p = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int i = 0; i < kChain; ++i) {
      __m256i xb = bcast4(x + 4 * (j + i));
      if constexpr (kSigned<D>) xb = _mm256_sign_epi8(xb, s[j + i]);
      p = i == 0 ? _mm256_maddubs_epi16(u[j + i], xb) : _mm256_add_epi16(p, _mm256_maddubs_epi16(u[j + i], xb));
    }
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
  }
  return sum;
}

// R rows (m0..) x the 8 columns of half `half` of block nb: y[m0 + r, 16 nb + 8 half + c].
template <class D, int R, int Terms>
TA_TARGET void tile(const Weights& w, const tm_vnni::Acts& a, int64_t N, int64_t m0, int64_t nb, int half, float* y) {
  constexpr int64_t kBytes = D::kBits * 64;
  constexpr int kSubs = D::kSubs, kQuads = 8 / kSubs;
  const int64_t G = w.G, M = a.M;
  const bool has_min = D::has_min(w);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* codes = w.codes + nb * G * kBytes + 32 * half;
  for (int64_t g = 0; g < G; ++g, codes += kBytes) {
#pragma GCC unroll 8  // every line of the group's codes fetched ahead (tile16)
    for (int l = 0; l < kBytes / 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(codes + 2048 + 64 * l), _MM_HINT_T0);
    __m256i u[8], s[8];
    group_codes<D>(codes, u);
    if constexpr (kSigned<D>) {
      for (int j = 0; j < 8; ++j) {
        s[j] = _mm256_xor_si256(u[j], _mm256_set1_epi8(static_cast<char>(0x80)));
        u[j] = _mm256_abs_epi8(s[j]);
      }
    }
    __m256 sc[kSubs], mn[kSubs];
    scales<D>(w, nb, g, half, sc);
    if (has_min) mins<D>(w, nb, g, half, mn);
    const int64_t at = g * M + m0;
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = a.xq + (at + r) * Terms * kGroup;
      const int32_t* msum = a.msum + (at + r) * kMergedSums;
      const __m256 dxr = _mm256_set1_ps(a.dx[(at + r) * Terms + Terms - 1]);
      for (int h = 0; h < kSubs; ++h) {
        __m256i d[Terms];
        for (int t = 0; t < Terms; ++t) {
          // codes stored + offset: the last term's sum starts from -offset * the merged sum of x
          int32_t start = 0;
          if constexpr (!kSigned<D> && D::kOffset != 0)
            if (t == Terms - 1) start = -D::kOffset * msum[kSubs == 1 ? 0 : 1 + h];
          d[t] = dot<D, kQuads>(u + h * kQuads, s + h * kQuads, xq + t * kGroup + h * 16, _mm256_set1_epi32(start));
        }
        const __m256i mrg = Terms == 1 ? d[0] : _mm256_add_epi32(_mm256_slli_epi32(d[0], 8), d[Terms - 1]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(mrg), dxr), sc[h], acc[r]);
        if (has_min) {
          const float xs = kSubs == 1 ? a.qsum[at + r] : a.hqsum[(at + r) * 2 + h];
          acc[r] = _mm256_fmadd_ps(mn[h], _mm256_set1_ps(xs), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (m0 + r) * N + nb * kCols + kHalf * half, acc[r]);
}

// R rows (1-2: decode) x all 16 columns of block nb, both halves at once: each pair of quads (J,
// J + 4) of both halves is unpacked once and multiplied into every (row, term, half, sub-block)
// int16 sum, widened into int32 every kChain quads; an activation broadcast serves both halves.
template <class D, int R, int Terms>
TA_TARGET void tile16(const Weights& w, const tm_vnni::Acts& a, int64_t N, int64_t m0, int64_t nb, float* y) {
  constexpr int64_t kBytes = D::kBits * 64;
  constexpr int kSubs = D::kSubs, kChain = chain<D>() < 8 / kSubs ? chain<D>() : 8 / kSubs;  // quads a sum sees
  const int64_t G = w.G, M = a.M;
  const bool has_min = D::has_min(w);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint8_t* codes = w.codes + nb * G * kBytes;
  for (int64_t g = 0; g < G; ++g, codes += kBytes) {
    // the group's codes fetched ahead, every line (quant_vnni.h tile: 2 kB, 4 kB for 8-bit codes)
    constexpr int kAhead = D::kBits == 8 ? 4096 : 2048;
#pragma GCC unroll 8
    for (int l = 0; l < kBytes / 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(codes + kAhead + 64 * l), _MM_HINT_T0);
    const int64_t at = g * M + m0;
    __m256i s32[R][Terms][2][kSubs], s16[R][Terms][2][kSubs];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 16
      for (int t = 0; t < Terms; ++t)
        #pragma GCC unroll 16
        for (int hf = 0; hf < 2; ++hf)
          #pragma GCC unroll 16
          for (int h = 0; h < kSubs; ++h) {
            int32_t start = 0;
            if constexpr (!kSigned<D> && D::kOffset != 0)
              if (t == Terms - 1) start = -D::kOffset * a.msum[(at + r) * kMergedSums + (kSubs == 1 ? 0 : 1 + h)];
            s32[r][t][hf][h] = _mm256_set1_epi32(start);
          }
    auto step = [&]<int J>() TA_TARGET {
      __m256i c[2][2];
      pair_codes<D::kBits, J>(codes, c[0][0], c[0][1]);
      pair_codes<D::kBits, J>(codes + 32, c[1][0], c[1][1]);
      __m256i sg[2][2];
      #pragma GCC unroll 16
      for (int hf = 0; hf < 2; ++hf)
        #pragma GCC unroll 16
        for (int k = 0; k < 2; ++k) {
          if constexpr (D::kCodebook) c[hf][k] = _mm256_shuffle_epi8(codebook<D>(), c[hf][k]);
          if constexpr (kSigned<D>) {
            sg[hf][k] = _mm256_xor_si256(c[hf][k], _mm256_set1_epi8(static_cast<char>(0x80)));
            c[hf][k] = _mm256_abs_epi8(sg[hf][k]);
          }
        }
      // quads J (sub-block 0) and J + 4 (sub-block 1 of two, else 0) so far in each int16 sum
      constexpr int kIn = kSubs == 1 ? 2 * (J + 1) : J + 1;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        #pragma GCC unroll 16
        for (int t = 0; t < Terms; ++t) {
          const int8_t* x = a.xq + (at + r) * Terms * kGroup + t * kGroup;
          const __m256i xl = bcast4(x + 4 * J), xh = bcast4(x + 4 * (J + 4));
          #pragma GCC unroll 16
          for (int hf = 0; hf < 2; ++hf)
            #pragma GCC unroll 16
            for (int k = 0; k < 2; ++k) {
              const int h = kSubs == 2 ? k : 0;
              __m256i xb = k == 0 ? xl : xh;
              if constexpr (kSigned<D>) xb = _mm256_sign_epi8(xb, sg[hf][k]);
              const __m256i p = _mm256_maddubs_epi16(c[hf][k], xb);
              if constexpr (kChain == 1) {  // signed codes: every product widened at once
                s32[r][t][hf][h] = _mm256_add_epi32(s32[r][t][hf][h], _mm256_madd_epi16(p, ones));
                continue;
              }
              const bool fresh = kSubs == 1 ? (k == 0 && (kIn - 2) % kChain == 0) : (kIn - 1) % kChain == 0;
              s16[r][t][hf][h] = fresh ? p : _mm256_add_epi16(s16[r][t][hf][h], p);
            }
          if constexpr (kChain > 1 && kIn % kChain == 0)
            #pragma GCC unroll 16
            for (int hf = 0; hf < 2; ++hf)
              #pragma GCC unroll 16
              for (int h = 0; h < kSubs; ++h)
                s32[r][t][hf][h] = _mm256_add_epi32(s32[r][t][hf][h], _mm256_madd_epi16(s16[r][t][hf][h], ones));
        }
    };
    step.template operator()<0>();
    step.template operator()<1>();
    step.template operator()<2>();
    step.template operator()<3>();
    #pragma GCC unroll 16
    for (int hf = 0; hf < 2; ++hf) {
      __m256 sc[kSubs], mn[kSubs];
      scales<D>(w, nb, g, hf, sc);
      if (has_min) mins<D>(w, nb, g, hf, mn);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 dxr = _mm256_set1_ps(a.dx[(at + r) * Terms + Terms - 1]);
        #pragma GCC unroll 16
        for (int h = 0; h < kSubs; ++h) {
          const __m256i mrg = Terms == 1 ? s32[r][0][hf][h]
                                         : _mm256_add_epi32(_mm256_slli_epi32(s32[r][0][hf][h], 8), s32[r][Terms - 1][hf][h]);
          acc[r][hf] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(mrg), dxr), sc[h], acc[r][hf]);
          if (has_min) {
            const float xs = kSubs == 1 ? a.qsum[at + r] : a.hqsum[(at + r) * 2 + h];
            acc[r][hf] = _mm256_fmadd_ps(mn[h], _mm256_set1_ps(xs), acc[r][hf]);
          }
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + (m0 + r) * N + nb * kCols, acc[r][0]);
    _mm256_storeu_ps(y + (m0 + r) * N + nb * kCols + kHalf, acc[r][1]);
  }
}

constexpr int kMaxRows = 4;

// Blocks nb0..nb1 x rows m0..m1 in tiles of at most kMaxRows rows, as even as possible.
template <class D, int Terms>
TA_TARGET void blocks_of(const Weights& w, const tm_vnni::Acts& a, int64_t m0, int64_t m1, int64_t N, int64_t nb0,
                         int64_t nb1, float* y) {
  const int64_t tiles = (m1 - m0 + kMaxRows - 1) / kMaxRows;
  if (m1 - m0 <= 2) {
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      if (m1 - m0 == 2) tile16<D, 2, Terms>(w, a, N, m0, nb, y);
      else tile16<D, 1, Terms>(w, a, N, m0, nb, y);
    }
    return;
  }
  for (int64_t nb = nb0; nb < nb1; ++nb)
    for (int half = 0; half < 2; ++half) {
      int64_t m = m0;
      for (int64_t i = 0; i < tiles; ++i) {
        const int64_t left = tiles - i, r = (m1 - m + left - 1) / left;
        switch (r) {
          case 4: tile<D, 4, Terms>(w, a, N, m, nb, half, y); break;
          case 3: tile<D, 3, Terms>(w, a, N, m, nb, half, y); break;
          case 2: tile<D, 2, Terms>(w, a, N, m, nb, half, y); break;
          default: tile<D, 1, Terms>(w, a, N, m, nb, half, y); break;
        }
        m += r;
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Values: scale * (code - offset) + min, rounded once as gguf-py rounds (quant_vnni.cpp decode_group).
// sink(j, part, v): quad j's columns 2 part, 2 part + 1 of the half (lane 4 c + e: column 2 part + c,
// input 4 j + e of the group).
template <class D, class Sink>
TA_TARGET TA_INLINE void decode_half(const Weights& w, int64_t nb, int64_t g, int half, Sink&& sink) {
  __m256i q[8];
  group_codes<D>(w.codes + (nb * w.G + g) * D::kBits * 64 + 32 * half, q);
  __m256 sc[D::kSubs], mn[D::kSubs];
  scales<D>(w, nb, g, half, sc);
  const bool has_min = D::has_min(w);
  if (has_min) mins<D>(w, nb, g, half, mn);
  for (int j = 0; j < 8; ++j) {
    const int h = D::kSubs == 2 ? j / 4 : 0;
    alignas(32) uint8_t bytes[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), q[j]);
    for (int part = 0; part < 4; ++part) {
      const __m256i idx = _mm256_setr_epi32(2 * part, 2 * part, 2 * part, 2 * part, 2 * part + 1, 2 * part + 1,
                                            2 * part + 1, 2 * part + 1);
      const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * part)));
      const __m256 code = _mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(D::kOffset)));
      const __m256 s = _mm256_permutevar8x32_ps(sc[h], idx);
      sink(j, part, has_min ? _mm256_fmadd_ps(s, code, _mm256_permutevar8x32_ps(mn[h], idx)) : _mm256_mul_ps(s, code));
    }
  }
}

// A half block's 8 rows of an fp32 [N, K] matrix (o at its first row, the group's first input).
struct MatrixSink {
  float* o;
  int64_t K;
  TA_TARGET TA_INLINE void operator()(int j, int part, __m256 v) const {
    _mm_storeu_ps(o + (2 * part) * K + 4 * j, _mm256_castps256_ps128(v));
    _mm_storeu_ps(o + (2 * part + 1) * K + 4 * j, _mm256_extractf128_ps(v, 1));
  }
};

// One column (c, 0..7 of the half) of a group: 32 fp32 values at o.
struct ColumnSink {
  float* o;
  int c;
  TA_TARGET TA_INLINE void operator()(int j, int part, __m256 v) const {
    if (c / 2 != part) return;
    _mm_storeu_ps(o + 4 * j, c % 2 == 0 ? _mm256_castps256_ps128(v) : _mm256_extractf128_ps(v, 1));
  }
};

}  // namespace tm_avx2
