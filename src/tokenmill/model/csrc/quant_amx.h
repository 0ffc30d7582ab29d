#pragma once
// Quantized linear layers on AMX-BF16 tiles for steps of many rows, y[M, N] = x[M, K] @ W^T, over
// the same column-blocked weights and block decoders as the VNNI kernel (quant_vnni.h,
// quant_blocks.h).
//
// Why: on the VNNI kernel a prompt step's 2-term activations cost 16 vpdpbusd a group, row and
// block, and that is ~75 % of a 512-token prompt of the formats it runs (Q5_0, Q6_K, Q8_0, Q4_K, ...).
// AMX multiplies a 16 x 32 bf16 tile by a 32 x 16 one in one instruction. A group's codes minus the
// format's offset are small integers (-128..255) that bf16 holds exactly, and the activations go in
// as two bf16 terms (hi = bf16(x), lo = bf16(x - hi): ~16 bits), so each group's 16 x 16 sums are
// two `tdpbf16ps` into an fp32 tile, scaled by the group's 16 column scales (and its mins times the
// rows' sums of x) into fp32 results on the vector units, as the VNNI tiles scale their int32 sums.
// Nothing is rounded but the activations' ~16 bits and fp32 sums: closer to the float64 product than
// the VNNI kernel's two int8 terms (~15 bits), and oneDNN's bf16 GEMM over dequantized weights
// (8-bit weights, activations and outputs) is what the formats with more than 4-bit codes failed
// the quality bound on. Q8_0 and Q6_K take hi alone (Q8_0's weights exact, Q6_K's scales multiplied
// into two bf16 planes of ~16 bits): the quality bound holds with the activations' 8 bits (measured:
// kTerms, kFoldsScale, quant_amx_weights.h).
//
// Layout: a block's codes are decoded once per call into AMX's B layout (quant_amx_weights.h; per
// group of 32 inputs: 16 rows of 16 columns x 2 consecutive inputs, 1 kB), a chunk of blocks and a
// span of the inputs at a time so that it stays in L2 while every 16-row tile of the step runs over it
// (blocks_of). Formats with two sub-blocks a group take each half as a unit of 16 inputs with its own
// scale (Q2_K), or fold the sub-block scales into B (kFolds: Q3_K), or all of the scale (kFoldsScale:
// Q6_K; no scaling between a span's groups). Units of 32 inputs run two
// row tiles x two column blocks at a time (tile_pair), so that each A and B tile loaded serves two
// products. The ops' entry points (x split, blocks shared between threads): quant_amx_calls.h.
// Linux hands a process the tile registers only when asked (arch_prctl): amx_ready() (amx_tiles.h) asks once.

#include <c10/util/Exception.h>

#include <immintrin.h>

#include "exp_approx.h"
#include "quant_amx_acts.h"
#include "quant_amx_weights.h"
#include "quant_blocks.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tm_amx {

using tm_vnni::kCols;
using tm_vnni::kGroup;
using tm_vnni::Weights;

#if TM_AMX_COMPILES

// The tile layout for units of W inputs (32, or 16 for the formats with two sub-blocks a group).
// W = 32 (tile_pair): tiles 0-3 the sums C of two row tiles x two column blocks (C[2 i + j]: row tile
// i, block j), 4-5 the row tiles' A (hi, then lo), 6-7 the blocks' B. W = 16 (tile_block): tiles 0-3
// and 4-7 two sets of (sums C, A hi, A lo, B).
// (A static object: GCC's `_tile_loadconfig` tells the compiler it reads 8 bytes, so stores to a
// local configuration past those may be dropped as dead; they happened not to be here, and did in
// prompt_flash_amx.h.)
template <int W>
TA_TARGET TA_INLINE void configure() {
  static const TileConfig config = [] {
    TileConfig c{};
    c.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      const int role = W == 32 ? (t < 4 ? 0 : t < 6 ? 1 : 3) : t % 4;  // C, A hi, A lo, B
      c.rows[t] = role == 3 ? W / 2 : 16;  // B: W / 2 pairs of inputs x 16 columns
      c.colsb[t] = role == 1 || role == 2 ? 2 * W : 64;  // A: 16 rows x W bf16; C: 16 fp32
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

// acc[r] += the stored unit sums of row r * the unit's scales (+ its mins * the row's sum of x).
template <bool HasMin>
TA_TARGET TA_INLINE void scale_unit(__m512 (&acc)[kTileRows], const float* c, const float* sc, const float* mn,
                                    const float* sums, int64_t sum_stride) {
  const __m512 s = _mm512_loadu_ps(sc);
  if constexpr (HasMin) {
    const __m512 m = _mm512_loadu_ps(mn);
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r)
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * sum_stride]), _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), s, acc[r]));
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), s, acc[r]);
  }
}

// The same with the 16 rows' accumulators in memory (acc and c: [16][16] fp32).
template <bool HasMin>
TA_TARGET TA_INLINE void scale_unit(float* acc, const float* c, const float* sc, const float* mn, const float* sums,
                                    int64_t sum_stride) {
  const __m512 s = _mm512_loadu_ps(sc);
  if constexpr (HasMin) {
    const __m512 m = _mm512_loadu_ps(mn);
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r)
      _mm512_store_ps(acc + 16 * r, _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * sum_stride]),
                                                    _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), s, _mm512_load_ps(acc + 16 * r))));
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r)
      _mm512_store_ps(acc + 16 * r, _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), s, _mm512_load_ps(acc + 16 * r)));
  }
}

// silu(g) * u on 16 lanes, fused_ops.h's silu_mul to the bit (exp_approx.h).
TA_TARGET TA_INLINE __m512 silu_mul16(__m512 g, __m512 u) {
  using F = float __attribute__((vector_size(64)));
  using I = int32_t __attribute__((vector_size(64)));
  return (__m512)tm_math::silu_mul_t<F, I>((F)g, (F)u);
}

// A run of Run units' products into one set of tiles (sums C, A hi, A lo, B: literal tile numbers,
// which the instructions encode), from unit U0 on: C holds their sum.
#define TA_RUN_MULTIPLY(C, AH, AL, B, U0)                     \
  do {                                                         \
    for (int i = 0; i < Run; ++i) {                            \
      const int64_t uu = (U0) + i;                             \
      _tile_loadd(AH, hi + uu * W, stride);                    \
      _tile_loadd(B, b + uu * kUnitB, 64);                     \
      if (i == 0) _tile_zero(C);                               \
      _tile_dpbf16ps(C, AH, B);                                \
      _tile_loadd(AL, lo + uu * W, stride);                    \
      _tile_dpbf16ps(C, AL, B);                                \
    }                                                          \
  } while (0)
#define TA_SET0(U0) TA_RUN_MULTIPLY(0, 1, 2, 3, U0)
#define TA_SET1(U0) TA_RUN_MULTIPLY(4, 5, 6, 7, U0)

// One 16-row tile (rows m0.., all 16 in x's padding) x one column block over units u0.. (a span of
// the inputs): the rows' sums in y (only its `rows` real ones), or added to it (`add`). b, sc, mn:
// the span's decode_block output, sc / mn one record a run of Run units (1; a super-block's 8 groups
// where the decoder folds its sub-block scales into B). Units of 16 inputs (Q2_K) run here: their
// sums are stored and scaled twice as often as 32's, and two tiles of accumulators in memory
// (tile_pair) made Q6_K's 512-row units of 16 ~9 % slower, where these are in registers.
template <int W, bool HasMin, int Run>
TA_TARGET void tile_block(const SplitActs& a, int64_t m0, int64_t rows, int64_t u0, int64_t units, const uint16_t* b,
                          const float* sc, const float* mn, float* y, int64_t ldy, bool add) {
  alignas(64) float c[2][kTileRows * kCols];
  __m512 acc[kTileRows];
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  if (add)  // a later span of the inputs: onto the earlier spans' sums
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_loadu_ps(y + r * ldy);
  const int64_t K = a.K, stride = K * 2;
  const uint16_t* hi = a.hi + m0 * K + u0 * W;
  const uint16_t* lo = a.lo + m0 * K + u0 * W;  // units of 16: always two terms (needs_of)
  const float* sums = HasMin ? (W == 16 ? a.sum16 : a.sum32) + m0 * (K / W) + u0 : nullptr;
  const int64_t sum_stride = K / W;
  constexpr int64_t kUnitB = W * 16;  // bf16 values of B a unit
  const int64_t runs = units / Run;
  int64_t r = 0;
  for (; r + 1 < runs; r += 2) {
    TA_SET0(r * Run);
    if (r > 0) {  // the previous pair's second run, multiplied while the first one was
      _tile_stored(4, c[1], 64);
      scale_unit<HasMin>(acc, c[1], sc + (r - 1) * kCols, mn + (r - 1) * kCols, sums + (r - 1), sum_stride);
    }
    TA_SET1((r + 1) * Run);
    _tile_stored(0, c[0], 64);
    scale_unit<HasMin>(acc, c[0], sc + r * kCols, mn + r * kCols, sums + r, sum_stride);
  }
  if (r > 0) {
    _tile_stored(4, c[1], 64);
    scale_unit<HasMin>(acc, c[1], sc + (r - 1) * kCols, mn + (r - 1) * kCols, sums + (r - 1), sum_stride);
  }
  if (r < runs) {  // an odd run count's last
    TA_SET0(r * Run);
    _tile_stored(0, c[0], 64);
    scale_unit<HasMin>(acc, c[0], sc + r * kCols, mn + r * kCols, sums + r, sum_stride);
  }
  for (int64_t i = 0; i < rows; ++i) _mm512_storeu_ps(y + i * ldy, acc[i]);
}
#undef TA_SET0
#undef TA_SET1
#undef TA_RUN_MULTIPLY

// tile_pair's products (tile numbers are the instructions' immediates): sums 0-3 of A tiles 4, 5 (the
// two row tiles, rows `stride` bytes apart) x B tiles 6, 7 (the two blocks). TA_MULTIPLY_A loads the
// A tiles (and the B tiles where B0 / B1 are not null), TA_MULTIPLY_B the B tiles, each load just
// before the first product that reads it: loading all four first measured 5-12 % slower.
#define TA_MULTIPLY_A(A0, A1, B0, B1)              \
  do {                                             \
    if ((B0) != nullptr) _tile_loadd(6, (B0), 64); \
    _tile_loadd(4, (A0), stride);                  \
    _tile_dpbf16ps(0, 4, 6);                       \
    if ((B1) != nullptr) _tile_loadd(7, (B1), 64); \
    _tile_dpbf16ps(1, 4, 7);                       \
    _tile_loadd(5, (A1), stride);                  \
    _tile_dpbf16ps(2, 5, 6);                       \
    _tile_dpbf16ps(3, 5, 7);                       \
  } while (0)
#define TA_MULTIPLY_B(B0, B1)  \
  do {                         \
    _tile_loadd(6, (B0), 64);  \
    _tile_dpbf16ps(0, 4, 6);   \
    _tile_dpbf16ps(2, 5, 6);   \
    _tile_loadd(7, (B1), 64);  \
    _tile_dpbf16ps(1, 4, 7);   \
    _tile_dpbf16ps(3, 5, 7);   \
  } while (0)

// Two 16-row tiles (rows m0.. and m0 + 16..; all in x's padding) x two column blocks over units u0.. (a
// span of the inputs), for units of 32 inputs: 2 x 2 tiles of sums a run of units, each A and B tile
// loaded serving two products where tile_block loads three tiles for two (an emulation of the loop:
// 34-38 ns a tile and group against 45-50; docs/benchmarks.md, "The quantized kernel's prompt tiles two
// by two"). rows[i]: tile i's real rows (0: no second tile, the first one's rows multiplied again and
// dropped); b[j], sc[j], mn[j]: block j's decode_block output (b[1] null: no second block, likewise),
// y[j]: its first row's sums in y, written or (`add`) added to. Run: units summed in a tile before it
// is stored and scaled (0: all of the span); Planes: B's (kPlanes); Terms: the activation terms
// multiplied (kTerms). Per unit and tile the arithmetic is tile_block's, in the same
// order: the same sums bit for bit (one plane, two terms).
template <int W, bool HasMin, int Run, int Planes, int Terms>
TA_TARGET void tile_pair(const SplitActs& a, int64_t m0, const int64_t (&rows)[2], int64_t u0, int64_t units,
                         const uint16_t* const (&b)[2], const float* const (&sc)[2], const float* const (&mn)[2],
                         float* const (&y)[2], int64_t ldy, bool add, bool glu = false, bool glu_bf16 = false) {
  static_assert(W == 32, "units of 16 inputs run tile_block");
  alignas(64) float c[4][kTileRows * kCols];
  alignas(64) float acc[4][kTileRows * kCols];
  const int64_t rt = rows[1] > 0 ? 2 : 1, bt = b[1] != nullptr ? 2 : 1;
  for (int t = 0; t < 4; ++t) {
    const int64_t i = t / 2, j = t % 2;
    for (int64_t r = 0; r < kTileRows; ++r) {
      const bool real = i < rt && j < bt && r < rows[i] && add;
      _mm512_store_ps(acc[t] + 16 * r, real ? _mm512_loadu_ps(y[j] + (16 * i + r) * ldy) : _mm512_setzero_ps());
    }
  }
  const int64_t K = a.K, stride = K * 2, m1 = rt == 2 ? m0 + kTileRows : m0;
  const uint16_t* hi0 = a.hi + m0 * K + u0 * W;
  const uint16_t* hi1 = a.hi + m1 * K + u0 * W;
  const uint16_t* lo0 = Terms == 2 ? a.lo + m0 * K + u0 * W : nullptr;  // null where not split (SplitNeeds)
  const uint16_t* lo1 = Terms == 2 ? a.lo + m1 * K + u0 * W : nullptr;
  const int64_t sum_stride = K / W;
  const float* sums0 = HasMin ? a.sum32 + m0 * sum_stride + u0 : nullptr;
  const float* sums1 = HasMin ? a.sum32 + m1 * sum_stride + u0 : nullptr;
  constexpr int64_t kUnitB = W * 16 * Planes;  // bf16 values of B a unit (its planes one after the other)
  const uint16_t* b0 = b[0];
  const uint16_t* b1 = bt == 2 ? b[1] : b[0];
  const float* sc1 = bt == 2 ? sc[1] : sc[0];
  const float* mn1 = bt == 2 ? mn[1] : mn[0];
  const int64_t run = Run > 0 ? Run : units;
  for (int64_t r = 0; r < units / run; ++r) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < run; ++i) {
      const int64_t uu = r * run + i;
      const uint16_t* bu0 = b0 + uu * kUnitB;
      const uint16_t* bu1 = b1 + uu * kUnitB;
      TA_MULTIPLY_A(hi0 + uu * W, hi1 + uu * W, bu0, bu1);
      if constexpr (Terms == 2) TA_MULTIPLY_A(lo0 + uu * W, lo1 + uu * W, nullptr, nullptr);
      if constexpr (Planes == 2) {  // B's second plane: by the A tiles loaded last, then (two terms) by A hi
        TA_MULTIPLY_B(bu0 + W * 16, bu1 + W * 16);
        if constexpr (Terms == 2) TA_MULTIPLY_A(hi0 + uu * W, hi1 + uu * W, nullptr, nullptr);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    scale_unit<HasMin>(acc[0], c[0], sc[0] + r * kCols, mn[0] + r * kCols, sums0 + r, sum_stride);
    if (bt == 2) scale_unit<HasMin>(acc[1], c[1], sc1 + r * kCols, mn1 + r * kCols, sums0 + r, sum_stride);
    if (rt == 2) {
      scale_unit<HasMin>(acc[2], c[2], sc[0] + r * kCols, mn[0] + r * kCols, sums1 + r, sum_stride);
      if (bt == 2) scale_unit<HasMin>(acc[3], c[3], sc1 + r * kCols, mn1 + r * kCols, sums1 + r, sum_stride);
    }
  }
  if (glu) {  // block 0 a gate's columns, block 1 the up projection's: silu(gate) * up into y[0]
    for (int64_t i = 0; i < rt; ++i)
      for (int64_t r = 0; r < rows[i]; ++r) {
        const __m512 v = silu_mul16(_mm512_load_ps(acc[2 * i] + 16 * r), _mm512_load_ps(acc[2 * i + 1] + 16 * r));
        if (glu_bf16)  // y[0] is bf16's address (blocks_of), rounded as split_into rounds hi
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(y[0]) + (16 * i + r) * ldy),
                              (__m256i)_mm512_cvtneps_pbh(v));
        else _mm512_storeu_ps(y[0] + (16 * i + r) * ldy, v);
      }
    return;
  }
  for (int64_t i = 0; i < rt; ++i)
    for (int64_t j = 0; j < bt; ++j)
      for (int64_t r = 0; r < rows[i]; ++r) _mm512_storeu_ps(y[j] + (16 * i + r) * ldy, _mm512_load_ps(acc[2 * i + j] + 16 * r));
}
#undef TA_MULTIPLY_B
#undef TA_MULTIPLY_A

// The step runs in pieces of kSpanGroups groups of inputs (1,024) x as many column blocks as fit
// kChunkBytes of decoded B, each piece over all of the rows, its sums added to the earlier pieces':
// every piece streams its span of the rows' split activations (512 rows: 2 MB), so a wide K (8B
// shapes: 4,096-14,336) no longer streams all of them (8-29 MB) for every few blocks. Spans are whole
// super-blocks (a multiple of 8 groups). Up to kOneSpanGroups (1,536 inputs) the whole K is one span:
// SmolLM2's down projection (48 groups) in spans of 32 + 16 ran 3-12 % slower than in one of 48 (Q8_0,
// Q4_K at 64 and 512 rows; `/work/scratch/s34/span_speed.py`, both alternating in one process), where
// 2,048 and 4,096 inputs in spans of 64 against 32 measured even (0.97-1.05x).
constexpr int64_t kChunkBytes = 1024 * 1024;
constexpr int64_t kSpanGroups = 32;
constexpr int64_t kOneSpanGroups = 48;
inline int64_t span_groups(int64_t G) { return G <= kOneSpanGroups ? G : kSpanGroups; }

// Inputs a unit of a format's tiles: a group of 32, or each half of it with its own scale (Q2_K),
// where the sub-block scales do not fold into B.
template <class D>
constexpr int kUnitInputs = kFolds<D> || kFoldsScale<D> ? kGroup : kGroup / D::kSubs;

// Whether blocks_of fuses silu(gate) * up for a gate and up projection stacked in w: units of 32
// inputs (every format but Q2_K) and K in one span (at most kOneSpanGroups groups).
template <class D>
bool glu_fuses_as(const Weights& w) {
  return kUnitInputs<D> == kGroup && w.G <= kOneSpanGroups;
}

// Blocks nb0..nb1 of one weight x all of a's rows, into y's columns (ldy = y's row length); two_terms:
// both activation terms whatever kTerms<D> says. up > 0 (a gate and an up projection stacked in w,
// glu_fuses_as): block nb is the gate's, nb + up the up projection's, and y's column block nb gets
// silu(gate) * up, in bf16 where bf16_y (y then bf16's address).
template <class D>
TA_TARGET void blocks_of(const Weights& w, const SplitActs& a, int64_t M, int64_t nb0, int64_t nb1, float* y, int64_t ldy,
                         bool two_terms, int64_t up = 0, bool bf16_y = false) {
  if (nb1 <= nb0) return;
  TORCH_CHECK(!bf16_y || up > 0, "AMX tiles: bf16 sums only from the silu(gate) * up epilogue");
  constexpr int W = kUnitInputs<D>;
  constexpr int Run = kFoldsScale<D> ? 0 : kFolds<D> ? tm_vnni::kSuper : 1;  // units summed in one tile (0: all)
  constexpr int64_t kUnitsPerGroup = kGroup / W;
  TORCH_CHECK(up == 0 || glu_fuses_as<D>(w), "AMX tiles: no silu(gate) * up for this weight");
  TORCH_CHECK(a.lo != nullptr || (W == kGroup && kTerms<D> == 1 && !two_terms), "AMX tiles: the activations' lo term was not split");
  TORCH_CHECK(a.sum16 != nullptr || !D::has_min(w), "AMX tiles: the activations' sums were not split");
  const int64_t span = span_groups(w.G), span_units = span * kUnitsPerGroup;
  const int64_t block_b = span * 512 * kPlanes<D>;  // bf16 values of decoded B a column block
  const int64_t block_bytes = 2 * block_b + 2 * span_units * kCols * 4;
  const int64_t per = up > 0 ? 2 : 1;  // decoded blocks a column block of y (slots: nb's, then nb + up's)
  const int64_t most = std::max<int64_t>(1, kChunkBytes / (per * block_bytes)), blocks = nb1 - nb0;
  const int64_t chunk = (blocks + (blocks + most - 1) / most - 1) / ((blocks + most - 1) / most);  // even chunks
  thread_local std::vector<uint16_t> bbuf;
  thread_local std::vector<float> sbuf;
  bbuf.resize(static_cast<size_t>(chunk * per * block_b));
  sbuf.resize(static_cast<size_t>(chunk * per * 2 * span_units * kCols));
  configure<W>();
  const bool has_min = D::has_min(w);
  auto slot_b = [&](int64_t slot) { return bbuf.data() + slot * block_b; };
  auto slot_s = [&](int64_t slot) { return sbuf.data() + slot * 2 * span_units * kCols; };
  for (int64_t c0 = nb0; c0 < nb1; c0 += chunk) {
    const int64_t c1 = std::min(nb1, c0 + chunk);
    for (int64_t g0 = 0; g0 < w.G; g0 += span) {
      const int64_t g1 = std::min(w.G, g0 + span), units = (g1 - g0) * kUnitsPerGroup, u0 = g0 * kUnitsPerGroup;
      for (int64_t nb = c0; nb < c1; ++nb)
        for (int64_t p = 0; p < per; ++p) {
          const int64_t slot = (nb - c0) * per + p;
          decode_block<D>(w, nb + p * up, g0, g1, slot_b(slot), slot_s(slot), slot_s(slot) + span_units * kCols);
        }
      if constexpr (W == 16) {
        for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
          const int64_t rows = std::min(kTileRows, M - m0);
          for (int64_t nb = c0; nb < c1; ++nb) {
            const uint16_t* b = slot_b(nb - c0);
            const float* s = slot_s(nb - c0);
            float* yt = y + m0 * ldy + nb * kCols;
            if (has_min) tile_block<W, true, Run>(a, m0, rows, u0, units, b, s, s + span_units * kCols, yt, ldy, g0 > 0);
            else tile_block<W, false, Run>(a, m0, rows, u0, units, b, s, s + span_units * kCols, yt, ldy, g0 > 0);
          }
        }
      } else {
        for (int64_t m0 = 0; m0 < M; m0 += 2 * kTileRows) {
          const int64_t rows[2] = {std::min(kTileRows, M - m0), std::clamp<int64_t>(M - m0 - kTileRows, 0, kTileRows)};
          // two slots a pair: two of y's blocks, or (up) one block's gate and up projection
          for (int64_t nb = c0; nb < c1; nb += 2 / per) {
            const int64_t slot = (nb - c0) * per;
            const bool two = up > 0 || nb + 1 < c1;
            const float* s0 = slot_s(slot);
            const float* s1 = two ? slot_s(slot + 1) : nullptr;
            const uint16_t* const b[2] = {slot_b(slot), two ? slot_b(slot + 1) : nullptr};
            const float* const sc[2] = {s0, s1};
            const float* const mn[2] = {s0 + span_units * kCols, two ? s1 + span_units * kCols : nullptr};
            float* const yt[2] = {bf16_y ? reinterpret_cast<float*>(reinterpret_cast<uint16_t*>(y) + m0 * ldy + nb * kCols)
                                         : y + m0 * ldy + nb * kCols,
                                  up > 0 ? nullptr : y + m0 * ldy + (nb + 1) * kCols};  // up: block 0's alone
            auto pair = [&]<int Terms>() {
              if (has_min) tile_pair<W, true, Run, kPlanes<D>, Terms>(a, m0, rows, u0, units, b, sc, mn, yt, ldy, g0 > 0, up > 0, bf16_y);
              else tile_pair<W, false, Run, kPlanes<D>, Terms>(a, m0, rows, u0, units, b, sc, mn, yt, ldy, g0 > 0, up > 0, bf16_y);
            };
            if (kTerms<D> == 2 || two_terms) pair.template operator()<2>();
            else if constexpr (kTerms<D> == 1) pair.template operator()<1>();  // only where a format has it
          }
        }
      }
    }
  }
  _tile_release();
}

// glu_fuses_as for w's format.
inline bool glu_fuses(const Weights& w) {
  bool fuses = false;
  tm_vnni::with_decoder(w.fmt, [&]<class D>() { fuses = glu_fuses_as<D>(w); });
  return fuses;
}

// Blocks nb0..nb1 of one weight of any format x all M rows of a (ldy = y's row length).
inline void blocks(const Weights& w, const SplitActs& a, int64_t M, int64_t nb0, int64_t nb1, float* y, int64_t ldy,
                   bool two_terms = false, int64_t up = 0, bool bf16_y = false) {
  tm_vnni::with_decoder(w.fmt, [&]<class D>() { blocks_of<D>(w, a, M, nb0, nb1, y, ldy, two_terms, up, bf16_y); });
}

#else
inline void blocks(const Weights&, const SplitActs&, int64_t, int64_t, int64_t, float*, int64_t, bool = false, int64_t = 0,
                   bool = false) {}
inline bool glu_fuses(const Weights&) { return false; }
#endif  // TM_AMX_COMPILES

}  // namespace tm_amx
