#pragma once
// The keys and values of a prompt attention call (prompt_flash_amx.h) as AMX tiles, read from the KV
// cache's pages where they lie: bf16 rows as they are, int8 rows as code x scale (rotated back out of
// H's basis where the call asks) rounded to bf16, the numbers fused_ops.int8_rows_values gives. No
// gathered copy of the context and no bf16 copy of int8 rows is made first: those cost ~4 % of a
// 1,000-token chunk's prompt after its prefix (index_select 108 ms and int8_rows_values 82 ms of
// ~2.8 s for 8 chunks).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "fused_ops.h"

namespace tm_flash {

constexpr int64_t kRows = 16;        // queries a block (a tile's rows)
constexpr int64_t kTileElems = 512;  // bf16 in a 16 x 64-byte tile

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The head dims the kernel takes: whole rows of 16 dims (a B tile's columns), at most 256 (its scratch).
inline bool takes_head_dim(int64_t D) { return D > 0 && D % 16 == 0 && D <= 256; }

// One cache's rows of the context, in position order: KV head g's row of position t lies at
// base + g x head_stride + (pages[t / page_size] x page_size + t % page_size) x slot_stride (bytes).
struct PagedRows {
  const uint8_t* base;
  int64_t head_stride, slot_stride;
  const int64_t* pages;
  int64_t page_size;
  bool int8, unrotate;  // int8 rows (a scale, then the codes); turned back out of H's basis
};

// One call: q [Q, H, D] (bf16, rows contiguous) at the last Q positions of T keys, out [Q, H, D].
// Not `causal` (cascade attention's shared prefix, cascade_attention.h): every query sees all T keys,
// and `stats` ([Q, H, 2] fp32, if not null) gets each query's softmax max (of the scaled scores) and
// sum, for merging with the part of its keys another kernel attends.
struct Problem {
  const uint16_t* q;
  int64_t q_token_stride, q_head_stride;
  PagedRows k, v;
  void* out;  // contiguous, float32 or (bf16_out) bf16
  bool bf16_out;
  int64_t Q, T, H, KVH, D;
  float scale;
  bool causal = true;
  float* stats = nullptr;
};

#if TM_AMX_COMPILES

// Row t of KV head g as D bf16 values: the cache row itself, or its int8 codes x scale (rotated back
// with `unrotate`) rounded into tmp by fused_ops.h's int8_row_values, x scratch of D floats.
TA_TARGET TA_INLINE const uint16_t* row_values(const PagedRows& rows, int64_t g, int64_t t, int64_t D, uint16_t* tmp,
                                               float* x) {
  const uint8_t* row = rows.base + g * rows.head_stride +
                       (rows.pages[t / rows.page_size] * rows.page_size + t % rows.page_size) * rows.slot_stride;
  if (!rows.int8) return reinterpret_cast<const uint16_t*>(row);
  tm_fused::int8_row_values(true, reinterpret_cast<const int8_t*>(row), D, rows.unrotate, x, tmp);  // AVX-512: AMX has it
  return tmp;
}

// The interleave of two 16-lane halves of a vector of 32 bf16 into pairs: word 2 n = a[n], 2 n + 1 =
// b[n] for [a | b] (AMX's B rows: two consecutive inputs of 16 columns).
TA_TARGET TA_INLINE __m512i interleave_halves(__m512i ab) {
  const __m512i index = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                          0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001a000a, 0x001b000b,
                                          0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f);
  return _mm512_permutexvar_epi16(index, ab);
}

// A 16 x 16 matrix of 32-bit words (r[i] = row i) transposed in place: unpacks within 128-bit lanes,
// then lanes across registers.
TA_TARGET TA_INLINE void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    r[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xdd);
  }
}

// Whether the keys' A tiles are read from the cache's rows where they lie: bf16 rows, pages of whole
// tiles (16 keys), and head dims of whole tiles (32: no dims past a row's end) up to 128. Gemma's
// 256-dim rows (512 bytes apart) were slower in place: 0.69-0.70 against 0.57-0.66 ms a 512-token
// prompt packed; at 64 and 128 dims leaving the packing out gained 4-15 %. Else they are packed.
inline bool keys_in_place(bool int8, int64_t page_size, int64_t D) {
  return !int8 && page_size % 16 == 0 && D % 32 == 0 && D <= 128;
}
inline bool keys_in_place(const Problem& pr) { return keys_in_place(pr.k.int8, pr.k.page_size, pr.D); }

// Where the keys' A tiles of 16 keys x 32 dims lie: tile (kt, j) at tiles[kt] + j x step, its rows
// `stride` bytes apart. In place: a page's rows (step 32 values, stride a slot); packed: whole tiles
// one after another (step a tile, stride 64 bytes).
struct KeyLayout {
  int64_t step, stride;
};

inline KeyLayout key_layout(const Problem& pr) {
  return keys_in_place(pr) ? KeyLayout{32, pr.k.slot_stride} : KeyLayout{kTileElems, 64};
}

// Rows of zeros for the key tiles past the context read in place (16 slots of up to 128 bf16).
alignas(64) inline const uint16_t kZeroKeys[16 * 128] = {};

// The keys of KV head g as A tiles: tiles[kt] (kt < Tp / 16) where keys 16 kt .. 16 kt + 15 begin, in
// place (bf16 pages) or packed into `dst` ([Tp / 16][D32 / 32] tiles, zero past T and D: the int8
// rows' values, or rows that do not fill whole tiles).
TA_TARGET inline void key_tiles(const Problem& pr, int64_t g, int64_t Tp, int64_t D32, uint16_t* dst, const uint16_t** tiles) {
  const int64_t J = D32 / 32;
  if (keys_in_place(pr)) {
    for (int64_t kt = 0; kt < Tp / 16; ++kt)
      tiles[kt] = 16 * kt < pr.T ? reinterpret_cast<const uint16_t*>(
                                       pr.k.base + g * pr.k.head_stride +
                                       (pr.k.pages[16 * kt / pr.k.page_size] * pr.k.page_size + 16 * kt % pr.k.page_size) *
                                           pr.k.slot_stride)
                                 : kZeroKeys;
    return;
  }
  alignas(64) uint16_t tmp[256];
  alignas(64) float x[256];
  std::memset(dst, 0, Tp * D32 * 2);
  for (int64_t key = 0; key < pr.T; ++key) {
    const uint16_t* row = row_values(pr.k, g, key, pr.D, tmp, x);
    for (int64_t j = 0; j * 32 < pr.D; ++j)
      std::memcpy(dst + ((key / 16 * J + j) * 16 + key % 16) * 32, row + 32 * j, std::min<int64_t>(32, pr.D - 32 * j) * 2);
  }
  for (int64_t kt = 0; kt < Tp / 16; ++kt) tiles[kt] = dst + kt * J * kTileElems;
}

// The values of KV head g as V^T's A tiles: [Tp / 32][D / 16] tiles, row d of tile (kb, c) = dim
// 16 c + d of keys 32 kb .. 32 kb + 31, zero past T: word p of row d = keys 2 p, 2 p + 1, so a tile is
// the transpose of the 16 rows of key pairs interleaved.
TA_TARGET inline void pack_values(const Problem& pr, int64_t g, int64_t Tp, uint16_t* dst) {
  const int64_t C = pr.D / 16;
  alignas(64) uint16_t tmp[32][256];
  alignas(64) float x[256];
  alignas(64) static const uint16_t zeros[256] = {};
  const uint16_t* rows[32];
  for (int64_t kb = 0; kb < Tp / 32; ++kb) {
    for (int64_t i = 0; i < 32; ++i)
      rows[i] = kb * 32 + i < pr.T ? row_values(pr.v, g, kb * 32 + i, pr.D, tmp[i], x) : zeros;
    for (int64_t c = 0; c < C; ++c) {
      __m512i r[16];
      for (int64_t p = 0; p < 16; ++p) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * p] + 16 * c));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * p + 1] + 16 * c));
        r[p] = interleave_halves(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
      }
      transpose16(r);
      for (int64_t d = 0; d < 16; ++d) _mm512_storeu_si512(dst + (kb * C + c) * kTileElems + 32 * d, r[d]);
    }
  }
}

#endif  // TM_AMX_COMPILES

}  // namespace tm_flash
