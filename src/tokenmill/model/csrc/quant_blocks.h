#pragma once
// Block decoders: what the VNNI kernels (quant_vnni.h) need to know of each GGUF block format.
//
// Why: the kernels have one loop skeleton per shape (decode tiles, dequantization, row lookup), and
// the formats differ only in how a group's codes are stored and where its scales come from. A decoder
// answers two questions for a block of 16 output columns and a group of 32 inputs:
//   pair<J>(): the unsigned codes of quads J and J + 4 (4 inputs x 16 columns each, byte 4c + e =
//              column c, input 4 J + e), the bytes vpdpbusd takes;
//   scales() / mins(): per sub-block of the group (kSubs = 1, or 2 of 16 inputs for Q2_K, Q3_K,
//              Q6_K), 16 columns' fp32 scale and min (one scale record may cover several groups:
//              `fmt_scale_groups`, 8 for super-blocks, 2 for Q2_0's blocks of 64, 4 for Q1_0's 128);
//   fetch_records(): those records of a group fetched into L2 ahead of it (fetch_far below).
// value = scale * (code - kOffset) + min; the kernels subtract kOffset in integers (the dot product
// starts from -kOffset * sum(x)), so it costs nothing per weight.
//
// Code layout (model/blocked_formats.py `pack_codes`), kBits * 64 bytes per block and group:
//   2 bits: 2 zmm, zmm t holds quad t + 2s at bits 2s..2s+1 (s = 0..3);
//   4 bits: 4 zmm, zmm t holds quad t in its low nibbles and quad t + 4 in its high nibbles;
//   8 bits: 8 zmm, quad j as it is;
//   1 bit: one plane of 64 bytes whose bit j is quad j's code (Q1_0, read as the code 2 b, offset 1);
//   3 bits = the 2-bit part + a plane of 64 bytes whose bit j is bit 2 of quad j's code;
//   5 bits = the 4-bit part + a plane (bit 4); 6 bits = the 4-bit part + a 2-bit part (bits 4, 5).
// Sub-block scales (`subs`, one byte per sub-block and column) and super-block d / dmin are the
// file's own numbers; scale = d * sub is exact in fp32 (an 11-bit by <= 8-bit product), so values
// equal gguf-py's.

#include <immintrin.h>

#include <cstdint>

namespace tm_vnni {

#define TV_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define TV_INLINE inline __attribute__((always_inline))

constexpr int64_t kGroup = 32;
constexpr int64_t kCols = 16;
constexpr int64_t kSuper = 8;  // groups of 32 in a 256-wide super-block

// Decoder ids (model/blocked_formats.py FORMATS): 4 and 8 are the legacy int4 / int8 layouts.
enum Fmt : int {
  kQ4 = 4, kQ8 = 8, kQ5_0 = 10, kQ5_1 = 11, kIQ4NL = 12, kQ2_0 = 13, kQ1_0 = 14, kMXFP4 = 15,
  kQ2K = 20, kQ3K = 21, kQ4K = 22, kQ5K = 23, kQ6K = 24, kIQ4XS = 25,
};

struct Weights {
  const uint8_t* codes;
  const uint16_t* scales;  // fp16 [N/16, G, 16] per group, or [N/16, S, 16] (d) per super-block
  const uint16_t* mins;    // the same shape (min, or dmin), or nullptr
  const uint8_t* subs;     // [N/16, S, subs, 16] sub-block scale bytes, or nullptr
  int64_t G;
  int fmt;
  int bits;
};

inline int fmt_bits(int fmt) {
  switch (fmt) {
    case kQ4: case kIQ4NL: case kQ4K: case kIQ4XS: case kMXFP4: return 4;
    case kQ8: return 8;
    case kQ5_0: case kQ5_1: case kQ5K: return 5;
    case kQ2K: case kQ2_0: return 2;
    case kQ1_0: return 1;
    case kQ3K: return 3;
    case kQ6K: return 6;
    default: return 0;
  }
}
constexpr bool fmt_super(int fmt) { return fmt >= kQ2K; }
// Groups of 32 inputs one scale record covers (model/blocked_formats.py BlockFormat.scale_groups).
inline int64_t fmt_scale_groups(int fmt) { return fmt_super(fmt) ? kSuper : fmt == kQ2_0 ? 2 : fmt == kQ1_0 ? 4 : 1; }
inline int fmt_subs(int fmt) { return fmt == kMXFP4 ? 1 : fmt == kIQ4XS ? 8 : 16; }  // sub-block bytes per scale record
// Whether `subs` holds bytes: the super-blocks' sub-block scales, MXFP4's E8M0 exponents (its only scale).
inline bool fmt_has_subs(int fmt) { return fmt_super(fmt) || fmt == kMXFP4; }
// Whether `scales` holds fp16 scales (every format but MXFP4, whose exponent bytes are its scales).
inline bool fmt_fp16_scales(int fmt) { return fmt != kMXFP4; }
// Whether the format has mins: required (K-quants with mins), allowed (legacy Q4: Q4_0's -8 d), never.
inline int fmt_mins(int fmt) { return fmt == kQ4 ? 1 : (fmt == kQ5_1 || fmt == kQ2K || fmt == kQ4K || fmt == kQ5K) ? 2 : 0; }

// ---------------------------------------------------------------------------------------------
// Codes. Shifts are on 16-bit lanes (x86 has no byte shifts); the masks keep each byte's own bits.

template <int S>
TV_TARGET TV_INLINE __m512i shift(__m512i v) {  // left by S, right by -S
  if constexpr (S > 0) return _mm512_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
  else return v;
}

// a | (b & mask) in one instruction
TV_TARGET TV_INLINE __m512i or_masked(__m512i a, __m512i b, __m512i mask) { return _mm512_ternarylogic_epi32(a, b, mask, 0xF8); }

template <int Bits, int J>
TV_TARGET TV_INLINE void pair_codes(const uint8_t* p, __m512i& lo, __m512i& hi) {
  if constexpr (Bits == 8) {
    lo = _mm512_loadu_si512(p + J * 64);
    hi = _mm512_loadu_si512(p + (J + 4) * 64);
  } else if constexpr (Bits == 1) {  // bit J (J + 4) of each byte to bit 1: the code 2 b
    const __m512i two = _mm512_set1_epi8(0x02), v = _mm512_loadu_si512(p);
    lo = _mm512_and_si512(shift<1 - J>(v), two);
    hi = _mm512_and_si512(shift<1 - (J + 4)>(v), two);
  } else if constexpr (Bits == 2 || Bits == 3) {
    const __m512i three = _mm512_set1_epi8(0x03);
    const __m512i v = _mm512_loadu_si512(p + (J % 2) * 64);
    lo = _mm512_and_si512(shift<-2 * (J / 2)>(v), three);
    hi = _mm512_and_si512(shift<-2 * (J / 2 + 2)>(v), three);
    if constexpr (Bits == 3) {
      const __m512i bit = _mm512_set1_epi8(0x04), h = _mm512_loadu_si512(p + 128);
      lo = or_masked(lo, shift<2 - J>(h), bit);
      hi = or_masked(hi, shift<2 - (J + 4)>(h), bit);
    }
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(p + J * 64);
    lo = _mm512_and_si512(v, nibble);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    if constexpr (Bits == 5) {
      const __m512i bit = _mm512_set1_epi8(0x10), h = _mm512_loadu_si512(p + 256);
      lo = or_masked(lo, shift<4 - J>(h), bit);
      hi = or_masked(hi, shift<-J>(h), bit);
    } else if constexpr (Bits == 6) {
      const __m512i two = _mm512_set1_epi8(0x30), h = _mm512_loadu_si512(p + 256 + (J % 2) * 64);
      lo = or_masked(lo, shift<4 - 2 * (J / 2)>(h), two);
      hi = or_masked(hi, shift<-2 * (J / 2)>(h), two);
    }
  }
}

// MXFP4's E2M1 values doubled (ggml's kvalues_mxfp4) + 128 (unsigned), in each 128-bit lane for vpshufb.
TV_TARGET TV_INLINE __m512i mxfp4_table() {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(static_cast<char>(128), static_cast<char>(129), static_cast<char>(130),
                                              static_cast<char>(131), static_cast<char>(132), static_cast<char>(134),
                                              static_cast<char>(136), static_cast<char>(140), static_cast<char>(128),
                                              127, 126, 125, 124, 122, 120, 116));
}

// IQ4's codebook + 128 (unsigned), in each 128-bit lane for vpshufb.
TV_TARGET TV_INLINE __m512i iq4_table() {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, static_cast<char>(129),
                                              static_cast<char>(141), static_cast<char>(153), static_cast<char>(166),
                                              static_cast<char>(181), static_cast<char>(197), static_cast<char>(217),
                                              static_cast<char>(241)));
}

// ---------------------------------------------------------------------------------------------
// Scales.

TV_TARGET TV_INLINE __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
TV_TARGET TV_INLINE __m512 load_u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
TV_TARGET TV_INLINE __m512 load_i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// One line into L2 (prefetcht1); a prefetch never faults, so addresses past a tensor's end are fine.
TV_INLINE void fetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

TV_TARGET TV_INLINE __m512 neg(__m512 v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))); }

// Scales and mins per group of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), or per block of
// ScaleGroups groups (Q2_0, Q1_0: the file's one d per 64 or 128 inputs, not repeated per group).
template <int Fmt_, int Bits, int Offset, bool Codebook, int Mins, int ScaleGroups = 1>
struct Legacy {
  static constexpr int kFmt = Fmt_, kBits = Bits, kSubs = 1, kOffset = Offset;
  static constexpr bool kCodebook = Codebook;
  TV_TARGET static TV_INLINE __m512i codebook() { return iq4_table(); }
  static TV_INLINE bool has_min(const Weights& w) { return Mins == 2 || (Mins == 1 && w.mins != nullptr); }
  static TV_INLINE int64_t at(const Weights& w, int64_t nb, int64_t g) {
    return (nb * (w.G / ScaleGroups) + g / ScaleGroups) * kCols;
  }
  TV_TARGET static TV_INLINE void scales(const Weights& w, int64_t nb, int64_t g, __m512 (&sc)[1]) {
    sc[0] = load_half16(w.scales + at(w, nb, g));
  }
  TV_TARGET static TV_INLINE void mins(const Weights& w, int64_t nb, int64_t g, __m512 (&mn)[1]) {
    mn[0] = load_half16(w.mins + at(w, nb, g));
  }
  static TV_INLINE void fetch_records(const Weights& w, int64_t nb, int64_t g) {
    fetch_l2(w.scales + at(w, nb, g));
    if (w.mins != nullptr) fetch_l2(w.mins + at(w, nb, g));
  }
};

// Super-block formats: d (and dmin) per 256 inputs, the file's integer sub-block scales in `subs`.
enum class Sub { kScaleMin6, kInt8, kNibblePair };  // Q4_K/Q5_K (sc, m bytes), Q3_K/Q6_K/IQ4_XS, Q2_K

template <int Fmt_, int Bits, int Subs, int Offset, bool Codebook, Sub Kind>
struct Super {
  static constexpr int kFmt = Fmt_, kBits = Bits, kSubs = Subs, kOffset = Offset;
  static constexpr bool kCodebook = Codebook;
  TV_TARGET static TV_INLINE __m512i codebook() { return iq4_table(); }
  static constexpr int kSubBytes = Fmt_ == kIQ4XS ? 8 : 16;
  static constexpr Sub kKind = Kind;
  static TV_INLINE bool has_min(const Weights&) { return Kind != Sub::kInt8; }
  static TV_INLINE const uint8_t* sub(const Weights& w, int64_t nb, int64_t g, int i) {
    const int64_t s = nb * (w.G / kSuper) + g / kSuper;
    return w.subs + (s * kSubBytes + i) * kCols;
  }
  static TV_INLINE int64_t at(const Weights& w, int64_t nb, int64_t g) { return (nb * (w.G / kSuper) + g / kSuper) * kCols; }
  TV_TARGET static TV_INLINE void scales(const Weights& w, int64_t nb, int64_t g, __m512 (&sc)[Subs]) {
    const __m512 d = load_half16(w.scales + at(w, nb, g));
    const int j = static_cast<int>(g % kSuper);
    for (int h = 0; h < Subs; ++h) {
      const uint8_t* p = sub(w, nb, g, Subs * j + h);
      if constexpr (Kind == Sub::kInt8) sc[h] = _mm512_mul_ps(d, load_i8x16(p));
      else if constexpr (Kind == Sub::kScaleMin6) sc[h] = _mm512_mul_ps(d, load_u8x16(p));
      else sc[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_cvtepu8_epi32(
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), _mm512_set1_epi32(15))));
    }
  }
  TV_TARGET static TV_INLINE void mins(const Weights& w, int64_t nb, int64_t g, __m512 (&mn)[Subs]) {
    const __m512 dmin = load_half16(w.mins + at(w, nb, g));
    const int j = static_cast<int>(g % kSuper);
    for (int h = 0; h < Subs; ++h) {
      if constexpr (Kind == Sub::kScaleMin6) {
        mn[h] = neg(_mm512_mul_ps(dmin, load_u8x16(sub(w, nb, g, 8 + j))));
      } else {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub(w, nb, g, Subs * j + h))));
        mn[h] = neg(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))));
      }
    }
  }
  // d, dmin and an eighth of the super-block's sub-scale bytes a group: all of them over its 8 groups.
  static TV_INLINE void fetch_records(const Weights& w, int64_t nb, int64_t g) {
    fetch_l2(w.scales + at(w, nb, g));
    if (w.mins != nullptr) fetch_l2(w.mins + at(w, nb, g));
    fetch_l2(sub(w, nb, g, 0) + (g % kSuper) * (kSubBytes * kCols / kSuper));
  }
};

// MXFP4: 4-bit E2M1 codes through their codebook, one E8M0 exponent byte per group of 32 (in `subs`,
// as the file holds it), scale 2^(e - 128) built in the exponent field: exactly ggml's
// e8m0_to_fp32_half (subnormal 2^-128 / 2^-127 for e = 0 / 1), so values equal gguf-py's.
struct DecMXFP4 {
  static constexpr int kFmt = kMXFP4, kBits = 4, kSubs = 1, kOffset = 128;
  static constexpr bool kCodebook = true;
  TV_TARGET static TV_INLINE __m512i codebook() { return mxfp4_table(); }
  static TV_INLINE bool has_min(const Weights&) { return false; }
  TV_TARGET static TV_INLINE void scales(const Weights& w, int64_t nb, int64_t g, __m512 (&sc)[1]) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.subs + (nb * w.G + g) * kCols)));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    sc[0] = _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
  }
  TV_TARGET static TV_INLINE void mins(const Weights&, int64_t, int64_t, __m512 (&mn)[1]) { mn[0] = _mm512_setzero_ps(); }
  static TV_INLINE void fetch_records(const Weights& w, int64_t nb, int64_t g) { fetch_l2(w.subs + (nb * w.G + g) * kCols); }
};

using DecQ4 = Legacy<kQ4, 4, 0, false, 1>;
using DecQ8 = Legacy<kQ8, 8, 128, false, 0>;
using DecQ5_0 = Legacy<kQ5_0, 5, 16, false, 0>;
using DecQ5_1 = Legacy<kQ5_1, 5, 0, false, 2>;
using DecIQ4NL = Legacy<kIQ4NL, 4, 128, true, 0>;
using DecQ2_0 = Legacy<kQ2_0, 2, 1, false, 0, 2>;  // (q - 1) d
using DecQ1_0 = Legacy<kQ1_0, 1, 1, false, 0, 4>;  // (2 b - 1) d: +d or -d
using DecQ2K = Super<kQ2K, 2, 2, 0, false, Sub::kNibblePair>;
using DecQ3K = Super<kQ3K, 3, 2, 4, false, Sub::kInt8>;
using DecQ4K = Super<kQ4K, 4, 1, 0, false, Sub::kScaleMin6>;
using DecQ5K = Super<kQ5K, 5, 1, 0, false, Sub::kScaleMin6>;
using DecQ6K = Super<kQ6K, 6, 2, 32, false, Sub::kInt8>;
using DecIQ4XS = Super<kIQ4XS, 4, 1, 128, true, Sub::kInt8>;

// Quads J and J + 4 of decoder D's group at p.
template <class D, int J>
TV_TARGET TV_INLINE void pair(const uint8_t* p, __m512i& lo, __m512i& hi) {
  pair_codes<D::kBits, J>(p, lo, hi);
  if constexpr (D::kCodebook) {
    const __m512i table = D::codebook();
    lo = _mm512_shuffle_epi8(table, lo);
    hi = _mm512_shuffle_epi8(table, hi);
  }
}

// Calls f.template operator()<D>() with the decoder of `fmt` (the one switch from format to code).
// A group's codes and scale records fetched into L2 kFarAhead bytes of codes ahead, on top of the
// kernels' nearer prefetch into L1 (quant_vnni.h tile). Batch-1 and few-row decode read every weight
// once a step, so the step runs at the rate the cores pull lines from memory; the L1 prefetch alone
// keeps too few lines in flight. Measured on the AMX VM of sessions 19-28, 2 threads: a plain read of
// 170 MB with L1 prefetch 30-33 GB/s, with this too 35-37; `bench latency` tg128 bundled Q4_1 283 /
// 293 -> 323 / 337 tok/s, Q8_0 mix 199 / 198 -> 229 / 234, Gemma 98 / 100 -> 109 / 113, the MoE
// 187 / 181 -> 201 / 211 (docs/benchmarks.md, session 28). 8-64 kB ahead measured alike; 8 kB kept.
constexpr int64_t kFarAhead = 8192;

template <class D>
TV_INLINE void fetch_far(const Weights& w, const uint8_t* codes, int64_t nb, int64_t g) {
  constexpr int64_t kBytes = D::kBits * 64;
#pragma GCC unroll 8
  for (int64_t l = 0; l < kBytes / 64; ++l) fetch_l2(codes + kFarAhead + 64 * l);
  D::fetch_records(w, nb, g + kFarAhead / kBytes);
}

template <class F>
TV_INLINE void with_decoder(int fmt, F&& f) {
  switch (fmt) {
    case kQ4: f.template operator()<DecQ4>(); break;
    case kQ8: f.template operator()<DecQ8>(); break;
    case kQ5_0: f.template operator()<DecQ5_0>(); break;
    case kQ5_1: f.template operator()<DecQ5_1>(); break;
    case kIQ4NL: f.template operator()<DecIQ4NL>(); break;
    case kQ2_0: f.template operator()<DecQ2_0>(); break;
    case kQ1_0: f.template operator()<DecQ1_0>(); break;
    case kMXFP4: f.template operator()<DecMXFP4>(); break;
    case kQ2K: f.template operator()<DecQ2K>(); break;
    case kQ3K: f.template operator()<DecQ3K>(); break;
    case kQ4K: f.template operator()<DecQ4K>(); break;
    case kQ5K: f.template operator()<DecQ5K>(); break;
    case kQ6K: f.template operator()<DecQ6K>(); break;
    case kIQ4XS: f.template operator()<DecIQ4XS>(); break;
    default: break;
  }
}

}  // namespace tm_vnni
