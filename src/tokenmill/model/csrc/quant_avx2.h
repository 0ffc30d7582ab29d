#pragma once
// The column-blocked quantized linear (quant_vnni.h's layout and formats) on CPUs with AVX2 but no
// AVX512-VNNI: y[M, N] = x[M, K] @ W^T, and the weight's values (fp32) for lookups and prompt_gemm "fp32".
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
// AVX2 has no vpdpbusd, and its byte product (vpmaddubsw) saturates int16 pair sums: 8-bit codes
// would overflow, and the two activation terms need a product each. So activations keep their two
// int8 terms merged into one int16 (256 q1 + q2, which the VNNI kernel forms from its two sums) and
// codes are widened to int16: one vpmaddwd multiplies both terms exactly into int32 (pairs of inputs
// per column), whatever the code width or offset. Measured against a vpmaddubsw version (2 threads,
// 2048 x 2048): the same at 1-2 rows (memory-bound), and Q8_0 / IQ4_XS prompts 1.6-2x faster (its
// codes stored + 128 had to run signed: |code - 128| times the activation given the code's sign).

#include <immintrin.h>

#include "blocked_weights.h"
#include "cpu_isa_cap.h"
#include "quant_acts.h"
#include "quant_avx2_acts.h"
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
T2_TARGET T2_INLINE __m256i shift(__m256i v) {  // left by S, right by -S (16-bit lanes)
  if constexpr (S > 0) return _mm256_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
  else return v;
}

T2_TARGET T2_INLINE __m256i or_masked(__m256i a, __m256i b, __m256i mask) {
  return _mm256_or_si256(a, _mm256_and_si256(b, mask));
}

T2_TARGET T2_INLINE __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

template <int Bits, int J>
T2_TARGET T2_INLINE void pair_codes(const uint8_t* p, __m256i& lo, __m256i& hi) {
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
T2_TARGET T2_INLINE __m256i codebook() {
  if constexpr (D::kFmt == tm_vnni::kMXFP4)
    return _mm256_setr_epi8(-128, -127, -126, -125, -124, -122, -120, -116, -128, 127, 126, 125, 124, 122, 120, 116,
                            -128, -127, -126, -125, -124, -122, -120, -116, -128, 127, 126, 125, 124, 122, 120, 116);
  else
    return _mm256_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59, -39, -15,
                            1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59, -39, -15);
}

// The 8 quads of a group's half block, quad j in q[j] (codes + kOffset, unsigned).
template <class D>
T2_TARGET T2_INLINE void group_codes(const uint8_t* p, __m256i (&q)[8]) {
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

T2_TARGET T2_INLINE __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
T2_TARGET T2_INLINE __m256i load_u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
T2_TARGET T2_INLINE __m256 neg(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.f)); }

template <class D>
T2_TARGET T2_INLINE void scales(const Weights& w, int64_t nb, int64_t g, int half, __m256 (&sc)[D::kSubs]) {
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
T2_TARGET T2_INLINE void mins(const Weights& w, int64_t nb, int64_t g, int half, __m256 (&mn)[D::kSubs]) {
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
// The product: codes widened to int16 (a quad's 8 columns x 4 inputs: two vectors of 4 columns,
// unpacked within 128-bit lanes so that no lane crosses: the column sums come out in order),
// times the row's merged int16 activations of the quad's 4 inputs (broadcast), vpmaddwd into int32
// lanes of (column, input pair), added across the sub-block's quads; both pairs of a column summed
// at the end (vphaddd). The int32 sum is the merged 256 D1 + D2 of quant_vnni.h (|x16| <= 32639,
// codes <= 255: 32 inputs < 2^28), so offsets start it at -offset * msum as there, and the codes
// stored + 128 (Q8_0, the codebooks) need no sign trick.

T2_TARGET T2_INLINE __m256i bcast8(const int16_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}

// R rows (m0..) x the 8 columns of each of H halves (H = 2: both, from half 0; H = 1: half `half0`).
template <class D, int R, int H, int Terms>
T2_TARGET void tile(const Weights& w, const tm_vnni::Acts& a, int64_t N, int64_t m0, int64_t nb, int half0, float* y) {
  constexpr int64_t kBytes = D::kBits * 64;
  constexpr int kSubs = D::kSubs, kQuads = 8 / kSubs;
  const int64_t G = w.G, M = a.M;
  const bool has_min = D::has_min(w);
  __m256 acc[R][H];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int hf = 0; hf < H; ++hf) acc[r][hf] = _mm256_setzero_ps();
  const uint8_t* codes = w.codes + nb * G * kBytes;
  for (int64_t g = 0; g < G; ++g, codes += kBytes) {
    // every line of the group's codes fetched ahead (quant_vnni.h tile: 2 kB, 4 kB for 8-bit codes):
    // with the weights streamed, Q5_K's one-row step went from ~35 to ~16 ns a group (1 thread)
    constexpr int kAhead = D::kBits == 8 ? 4096 : 2048;
#pragma GCC unroll 8
    for (int l = 0; l < kBytes / 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(codes + kAhead + 64 * l), _MM_HINT_T0);
    tm_vnni::fetch_far<D>(w, codes, nb, g);
    __m256i q[H][8];
#pragma GCC unroll 2
    for (int hf = 0; hf < H; ++hf) group_codes<D>(codes + 32 * (H == 2 ? hf : half0), q[hf]);
    const int64_t at = g * M + m0;
    __m256 sc[H][kSubs], mn[H][kSubs];
#pragma GCC unroll 2
    for (int hf = 0; hf < H; ++hf) {
      scales<D>(w, nb, g, H == 2 ? hf : half0, sc[hf]);
      if (has_min) mins<D>(w, nb, g, H == 2 ? hf : half0, mn[hf]);
    }
#pragma GCC unroll 2
    for (int h = 0; h < kSubs; ++h) {
      __m256i d[R][H][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int hf = 0; hf < H; ++hf) d[r][hf][0] = d[r][hf][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = h * kQuads; j < (h + 1) * kQuads; ++j) {
        __m256i c[H][2];
#pragma GCC unroll 2
        for (int hf = 0; hf < H; ++hf) {  // within 128-bit lanes: columns 0, 1 | 4, 5 and 2, 3 | 6, 7
          c[hf][0] = _mm256_unpacklo_epi8(q[hf][j], _mm256_setzero_si256());
          c[hf][1] = _mm256_unpackhi_epi8(q[hf][j], _mm256_setzero_si256());
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i x = bcast8(reinterpret_cast<const int16_t*>(a.xq + (at + r) * kLayoutTerms * kGroup) + 4 * j);
#pragma GCC unroll 2
          for (int hf = 0; hf < H; ++hf) {
            d[r][hf][0] = _mm256_add_epi32(d[r][hf][0], _mm256_madd_epi16(c[hf][0], x));
            d[r][hf][1] = _mm256_add_epi32(d[r][hf][1], _mm256_madd_epi16(c[hf][1], x));
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* msum = a.msum + (at + r) * kMergedSums;
        // codes stored + offset: the sum starts from -offset * the merged sum of x
        const __m256i start = _mm256_set1_epi32(D::kOffset == 0 ? 0 : -D::kOffset * msum[kSubs == 1 ? 0 : 1 + h]);
        const __m256 dxr = _mm256_set1_ps(a.dx[(at + r) * kLayoutTerms + Terms - 1]);
        const float xs = kSubs == 1 ? a.qsum[at + r] : a.hqsum[(at + r) * 2 + h];
#pragma GCC unroll 2
        for (int hf = 0; hf < H; ++hf) {
          // (c0 c0 c1 c1 | c4 c4 c5 c5) and (c2 c2 c3 c3 | c6 c6 c7 c7): the pair sums in column order
          const __m256i pairs = _mm256_hadd_epi32(d[r][hf][0], d[r][hf][1]);
          const __m256i mrg = _mm256_add_epi32(pairs, start);
          acc[r][hf] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(mrg), dxr), sc[hf][h], acc[r][hf]);
          if (has_min) acc[r][hf] = _mm256_fmadd_ps(mn[hf][h], _mm256_set1_ps(xs), acc[r][hf]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int hf = 0; hf < H; ++hf)
      _mm256_storeu_ps(y + (m0 + r) * N + nb * kCols + kHalf * (H == 2 ? hf : half0), acc[r][hf]);
}

constexpr int kMaxRows = 4;

// Blocks nb0..nb1 x rows m0..m1: 1-2 rows (decode) take both halves of a block at once, more rows
// one half at a time in tiles of at most kMaxRows rows, as even as possible.
template <class D, int Terms>
T2_TARGET void blocks_of(const Weights& w, const tm_vnni::Acts& a, int64_t m0, int64_t m1, int64_t N, int64_t nb0,
                         int64_t nb1, float* y) {
  if (m1 - m0 <= 2) {
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      if (m1 - m0 == 2) tile<D, 2, 2, Terms>(w, a, N, m0, nb, 0, y);
      else tile<D, 1, 2, Terms>(w, a, N, m0, nb, 0, y);
    }
    return;
  }
  const int64_t tiles = (m1 - m0 + kMaxRows - 1) / kMaxRows;
  for (int64_t nb = nb0; nb < nb1; ++nb)
    for (int half = 0; half < 2; ++half) {
      int64_t m = m0;
      for (int64_t i = 0; i < tiles; ++i) {
        const int64_t left = tiles - i, r = (m1 - m + left - 1) / left;
        switch (r) {
          case 4: tile<D, 4, 1, Terms>(w, a, N, m, nb, half, y); break;
          case 3: tile<D, 3, 1, Terms>(w, a, N, m, nb, half, y); break;
          case 2: tile<D, 2, 1, Terms>(w, a, N, m, nb, half, y); break;
          default: tile<D, 1, 1, Terms>(w, a, N, m, nb, half, y); break;
        }
        m += r;
      }
    }
}

// Blocks nb0..nb1 x rows m0..m1 of a weight of any format.
template <int Terms>
T2_TARGET void blocks(const Weights& w, const tm_vnni::Acts& a, int64_t m0, int64_t m1, int64_t N, int64_t nb0,
                      int64_t nb1, float* y) {
  tm_vnni::with_decoder(w.fmt, [&]<class D>() { tm_avx2::blocks_of<D, Terms>(w, a, m0, m1, N, nb0, nb1, y); });
}

// ---------------------------------------------------------------------------------------------
// Values: scale * (code - offset) + min, rounded once as gguf-py rounds (quant_vnni.cpp decode_group).
// sink(j, part, v): quad j's columns 2 part, 2 part + 1 of the half (lane 4 c + e: column 2 part + c,
// input 4 j + e of the group).
template <class D, class Sink>
T2_TARGET T2_INLINE void decode_half(const Weights& w, int64_t nb, int64_t g, int half, Sink&& sink) {
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
  T2_TARGET T2_INLINE void operator()(int j, int part, __m256 v) const {
    _mm_storeu_ps(o + (2 * part) * K + 4 * j, _mm256_castps256_ps128(v));
    _mm_storeu_ps(o + (2 * part + 1) * K + 4 * j, _mm256_extractf128_ps(v, 1));
  }
};

// One column (c, 0..7 of the half) of a group: 32 fp32 values at o.
struct ColumnSink {
  float* o;
  int c;
  T2_TARGET T2_INLINE void operator()(int j, int part, __m256 v) const {
    if (c / 2 != part) return;
    _mm_storeu_ps(o + 4 * j, c % 2 == 0 ? _mm256_castps256_ps128(v) : _mm256_extractf128_ps(v, 1));
  }
};

}  // namespace tm_avx2
