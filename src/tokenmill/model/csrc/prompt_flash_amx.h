#pragma once
// Causal attention of a prompt chunk over its context on AMX-BF16 tiles: bf16 queries, keys and
// values, fp32 scores, softmax and sums, as torch's flash kernel computes them, at ~2x its speed.
//
// Why: torch's flash attention (oneDNN brgemm on the tiles) was ~42 % of a 1,000-token chunk's prompt
// time after a 1,000-token prefix at SmolLM2's shape (head_dim 64, 9 heads over 3 KV heads): 8 ms a
// layer for 3.5 GFLOP. The products are not what costs; the softmax is (one exp per score), and then
// moving scores between the tiles and the vector units.
//
// How, per item of (KV head, up to kHeads of its query heads, 16 queries), chunk by chunk of keys:
//  - scores transposed, S^T = K Q^T: K's tiles stream from L2 once for all the item's heads, the
//    queries' B tiles are small and stay in L1, a chunk's scores in L1 / L2;
//  - the softmax with a query per lane: running max and sum as vectors, no horizontal reductions,
//    the causal mask a lane compare on the diagonal's chunk only, the exp a short polynomial;
//  - outputs transposed, O^T = V^T P^T: the weights leave the softmax already as B rows (key pairs
//    interleaved), V^T's tiles stream once for all heads; the running outputs are rescaled as the
//    max grows (flash attention's update), and transposed back once at the end.
// Layouts: K as A tiles of 16 keys x 32 dims, read in place from bf16 pages or packed; V^T as A tiles
// of 16 dims x 32 keys, packed per call from the cache's pages (prompt_flash_pack.h). Keys run to a
// multiple of 64: past the context a score is masked (never in a max, its weight zero, whatever the
// slot held), and the packed values there are zero, so padded weights are zero times zero. Query i
// of Q sits at position T - Q + i and sees keys 0 .. T - Q + i (every key where not causal); an item
// computes only the chunks some query of it sees.

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "prompt_flash_pack.h"

namespace tm_flash {

#if TM_AMX_COMPILES

// Every tile 16 rows x 64 bytes: C (16 x 16 fp32), A (16 x 32 bf16) and B (16 pairs x 16 columns).
TA_TARGET TA_INLINE void configure() { _tile_loadconfig(&tm_amx::full_tiles()); }

// Keys a chunk: the running max is updated (and the outputs rescaled) once a chunk, and a chunk's
// scores and weights (up to 4 heads x 256 keys x 16 queries, fp32 and bf16: 96 kB) stay in L1 / L2
// between the tiles and the softmax. Measured at 1,000 queries over 2,000 keys (SmolLM2's heads),
// chunks of 64 / 128 / 256 / 512 / 1,024 keys: 4.3 / 3.7-3.9 / 3.3-3.8 / 3.7-4.0 / 3.9-4.0 ms.
constexpr int64_t kChunk = 256;
// Query heads of one KV head an item takes at once (a tile of sums each): each K and V tile is loaded
// once for all of them.
constexpr int64_t kHeads = 4;

// The tile ops below name their registers as literal numbers (GCC's tile intrinsics paste them into
// their asm): sums of head r in tile r (0-3), the streamed K / V^T tile (`a`) in A = 4 or 6, head r's
// B tile (`b` + r x `stride`) in 5 or 7, alternating so that a load need not wait for the product
// reading the last one. The A tile's rows lie `astride` bytes apart.
#define TM_FLASH_PRODUCTS(R, A, a, astride, b, stride)                               \
  _tile_loadd(A, a, astride);                                                       \
  _tile_loadd(5, b, 64);                                                            \
  _tile_dpbf16ps(0, A, 5);                                                          \
  if constexpr (R > 1) {                                                            \
    _tile_loadd(7, (b) + (stride), 64);                                             \
    _tile_dpbf16ps(1, A, 7);                                                        \
  }                                                                                 \
  if constexpr (R > 2) {                                                            \
    _tile_loadd(5, (b) + 2 * (stride), 64);                                         \
    _tile_dpbf16ps(2, A, 5);                                                        \
  }                                                                                 \
  if constexpr (R > 3) {                                                            \
    _tile_loadd(7, (b) + 3 * (stride), 64);                                         \
    _tile_dpbf16ps(3, A, 7);                                                        \
  }

// The R heads' sums: zeroed, or stored (head r's at `at` + r x `stride` floats, rows of 64 bytes).
#define TM_FLASH_ZERO(R)                \
  _tile_zero(0);                        \
  if constexpr (R > 1) _tile_zero(1);   \
  if constexpr (R > 2) _tile_zero(2);   \
  if constexpr (R > 3) _tile_zero(3);
#define TM_FLASH_STORE(R, at, stride)                                 \
  _tile_stored(0, at, 64);                                            \
  if constexpr (R > 1) _tile_stored(1, (at) + (stride), 64);          \
  if constexpr (R > 2) _tile_stored(2, (at) + 2 * (stride), 64);      \
  if constexpr (R > 3) _tile_stored(3, (at) + 3 * (stride), 64);

// Transposed scores S^T = K Q^T of R heads for the chunk's n keys (its key tiles from `keys` as
// `kl` lays them out, see key_tiles): the queries' B tiles qb ([kHeads][D32 / 32][16 pairs x 16
// queries x 2]); into st ([kHeads][kChunk keys, 16 queries] fp32).
template <int R>
TA_TARGET inline void chunk_scores(const uint16_t* qb, int64_t J, const uint16_t* const* keys, KeyLayout kl, int64_t n,
                                   float* st) {
  for (int64_t kt = 0; kt < n / 16; ++kt) {
    TM_FLASH_ZERO(R)
    for (int64_t j = 0; j < J; ++j) {
      const uint16_t* a = keys[kt] + j * kl.step;
      const uint16_t* b = qb + j * kTileElems;
      if (j % 2 == 0) {
        TM_FLASH_PRODUCTS(R, 4, a, kl.stride, b, J * kTileElems)
      } else {
        TM_FLASH_PRODUCTS(R, 6, a, kl.stride, b, J * kTileElems)
      }
    }
    TM_FLASH_STORE(R, st + kt * 256, kChunk * 16)
  }
}

// Transposed outputs O^T = V^T P^T of R heads for the chunk's n keys, dims 16 c .. 16 c + 15: V^T's
// tiles from `values`, the weights' B tiles pt ([kHeads][kChunk / 2 pairs x 16 queries x 2]); into
// o ([kHeads][16 dims, 16 queries] fp32).
template <int R>
TA_TARGET inline void chunk_outputs(const uint16_t* pt, int64_t n, const uint16_t* values, int64_t C, int64_t c, float* o) {
  TM_FLASH_ZERO(R)
  for (int64_t kb = 0; kb < n / 32; ++kb) {
    const uint16_t* a = values + (kb * C + c) * kTileElems;
    const uint16_t* b = pt + kb * kTileElems;
    if (kb % 2 == 0) {
      TM_FLASH_PRODUCTS(R, 4, a, 64, b, kChunk * 16)
    } else {
      TM_FLASH_PRODUCTS(R, 6, a, 64, b, kChunk * 16)
    }
  }
  TM_FLASH_STORE(R, o, 256)
}

// 2^x for x <= 0 (a little above 0 from rounding is fine): 2^n * P(f), n = round(x), f = x - n in
// [-0.5, 0.5], P a degree-4 fit of 2^f (relative error < 3e-6), 2^n applied by vscalefps (0 below
// 2^-149). Not the shared exp (exp_approx.h, ~17 vector operations) but 7: the weights it makes are
// rounded to bf16 (2^-9) before they multiply the values, and the softmax is most of the time (the
// shared one cost 3.85 -> 4.95 ms a layer). Measured against exact mode on 10,200 positions of prose
// (`bench quality --text`), fast mode's top-1 agreement and KL were those of torch's flash kernel:
// 98.77 % / 0.000248 against 98.76 % / 0.000248; degree 6 or the shared exp moved the top-1 of the
// bundled 1,785 positions either way (98.88-99.22 %, this one 98.94 %): which ties flip is chance.
TA_TARGET TA_INLINE __m512 exp2_nonpos(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.5605105e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917040e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024981e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312197e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999917e-1f));
  return _mm512_scalef_ps(p, n);
}

// The running softmax of one head's 16 queries (a lane each): max m of the raw scores, sum l of
// exp((s - m) * scale), both so far.
struct RowState {
  __m512 m, l;
};

// One head's weights over a chunk of n keys starting at key c0, from its scores st ([n keys, 16
// queries] fp32), into pt (AMX B rows: [n / 2 pairs, 16 queries, 2] bf16); query lane i sees keys up
// to last[i]. Updates the state; returns the factor exp((m - m') * scale) a lane's outputs so far
// are to be multiplied by.
TA_TARGET inline __m512 chunk_weights(const float* st, int64_t n, int64_t c0, __m512i last, int64_t last_min,
                                      float scale, uint16_t* pt, RowState& state) {
  const int64_t open = std::clamp<int64_t>(last_min - c0 + 1, 0, n);  // keys every lane sees
  __m512 mv = state.m;
  int64_t k = 0;
  for (; k < open; ++k) mv = _mm512_max_ps(mv, _mm512_loadu_ps(st + 16 * k));
  for (; k < n; ++k) {
    const __mmask16 live = _mm512_cmpge_epi32_mask(last, _mm512_set1_epi32(static_cast<int32_t>(c0 + k)));
    mv = _mm512_mask_max_ps(mv, live, mv, _mm512_loadu_ps(st + 16 * k));
  }
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 vscale = _mm512_set1_ps(scale * kLog2e);
  const __m512 rescale = exp2_nonpos(_mm512_mul_ps(_mm512_sub_ps(state.m, mv), vscale));
  const __m512 shift = _mm512_mul_ps(mv, _mm512_set1_ps(-scale * kLog2e));
  __m512 sum = _mm512_setzero_ps();
  for (k = 0; k < n; k += 2) {
    __m512 e0 = exp2_nonpos(_mm512_fmadd_ps(_mm512_loadu_ps(st + 16 * k), vscale, shift));
    __m512 e1 = exp2_nonpos(_mm512_fmadd_ps(_mm512_loadu_ps(st + 16 * k + 16), vscale, shift));
    if (k + 1 >= open) {
      e0 = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(last, _mm512_set1_epi32(static_cast<int32_t>(c0 + k))), e0);
      e1 = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(last, _mm512_set1_epi32(static_cast<int32_t>(c0 + k + 1))), e1);
    }
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    _mm512_storeu_si512(pt + 16 * k, interleave_halves((__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
  }
  state.m = mv;
  state.l = _mm512_fmadd_ps(state.l, rescale, sum);
  return rescale;
}

// Scratch of one thread: an item's query tiles, a chunk's scores and weights, the running outputs.
struct Scratch {
  std::vector<uint16_t> qb;                           // [kHeads][D32 / 32] B tiles of the queries
  std::vector<float> acc;                             // [kHeads][D dims, 16 queries]: weights x values
  alignas(64) float st[kHeads * kChunk * 16];         // scores
  alignas(64) uint16_t pt[kHeads * kChunk * 16];      // weights
  alignas(64) float o[kHeads * 256];                  // a chunk's outputs, one tile of dims
  RowState state[kHeads];
  __m512 rescale[kHeads];
};

// Query block qb of R heads h0 .. h0 + R - 1 (of one KV head; its key tiles `keys`, see key_tiles):
// chunk by chunk, scores, weights and outputs; divided by the sums into out at the end.
template <int R>
TA_TARGET inline void query_block(const Problem& pr, int64_t h0, int64_t qb, const uint16_t* const* keys, KeyLayout kl,
                                  const uint16_t* values, int64_t D32, Scratch& w) {
  const int64_t q0 = qb * kRows, rows = std::min(kRows, pr.Q - q0), offset = pr.T - pr.Q;
  // The last key lane 0 sees, and the last any lane sees: the causal diagonal, or every key.
  const int64_t first_last = pr.causal ? offset + q0 : pr.T - 1, last_seen = pr.causal ? offset + q0 + rows - 1 : pr.T - 1;
  const int64_t cols = round_up(last_seen + 1, 64), C = pr.D / 16, J = D32 / 32, D = pr.D;
  // The queries as B tiles: word (p, n) of tile j = dims 32 j + 2 p, + 1 of query n, the transpose
  // of the 16 queries' words.
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < J; ++j) {
      const int64_t words = std::min<int64_t>(16, D / 2 - 16 * j);
      __m512i t[16];
      for (int64_t i = 0; i < kRows; ++i)
        t[i] = i < rows ? _mm512_maskz_loadu_epi32((__mmask16)((1u << words) - 1),
                                                   pr.q + (q0 + i) * pr.q_token_stride + (h0 + r) * pr.q_head_stride + 32 * j)
                        : _mm512_setzero_si512();
      transpose16(t);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(w.qb.data() + (r * J + j) * kTileElems + 32 * p, t[p]);
    }
  }
  // Lane i sees keys up to offset + q0 + i (causal) or all; the padding lanes (zero queries) as the last row.
  const __m512i lane = pr.causal ? _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                 : _mm512_setzero_si512();
  const __m512i last = _mm512_min_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(first_last))),
                                        _mm512_set1_epi32(static_cast<int32_t>(last_seen)));
  std::fill(w.acc.begin(), w.acc.end(), 0.0f);
  for (int64_t r = 0; r < R; ++r) w.state[r] = {_mm512_set1_ps(-1e30f), _mm512_setzero_ps()};  // finite: no inf - inf
  for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
    const int64_t n = std::min(kChunk, cols - c0);
    chunk_scores<R>(w.qb.data(), J, keys + c0 / 16, kl, n, w.st);
    for (int64_t r = 0; r < R; ++r)
      w.rescale[r] = chunk_weights(w.st + r * kChunk * 16, n, c0, last, first_last, pr.scale, w.pt + r * kChunk * 16, w.state[r]);
    for (int64_t c = 0; c < C; ++c) {
      chunk_outputs<R>(w.pt, n, values + c0 / 32 * C * kTileElems, C, c, w.o);
      for (int64_t r = 0; r < R; ++r) {
        float* acc = w.acc.data() + (r * D + 16 * c) * 16;
        for (int64_t d = 0; d < 16; ++d)
          _mm512_storeu_ps(acc + 16 * d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + 16 * d), w.rescale[r], _mm512_loadu_ps(w.o + r * 256 + 16 * d)));
      }
    }
  }
  // Out: each tile of 16 dims x 16 queries transposed, query i's row times 1 / l[i].
  for (int64_t r = 0; r < R; ++r) {
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), w.state[r].l));
    if (pr.stats != nullptr) {
      alignas(64) float m[16], l[16];
      _mm512_store_ps(m, _mm512_mul_ps(w.state[r].m, _mm512_set1_ps(pr.scale)));
      _mm512_store_ps(l, w.state[r].l);
      for (int64_t i = 0; i < rows; ++i) {
        float* at = pr.stats + ((q0 + i) * pr.H + h0 + r) * 2;
        at[0] = m[i], at[1] = l[i];
      }
    }
    for (int64_t c = 0; c < C; ++c) {
      __m512i t[16];
      for (int64_t d = 0; d < 16; ++d) t[d] = _mm512_loadu_si512(w.acc.data() + (r * D + 16 * c + d) * 16);
      transpose16(t);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t out_at = ((q0 + i) * pr.H + h0 + r) * D + 16 * c;
        const __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(t[i]), _mm512_set1_ps(inv[i]));
        if (pr.bf16_out) _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(pr.out) + out_at),
                                             (__m256i)_mm512_cvtneps_pbh(x));
        else _mm512_storeu_ps(static_cast<float*>(pr.out) + out_at, x);
      }
    }
  }
}

// A thread's scratch for run_items, for head dim D (D32 = D rounded up to 32).
inline std::unique_ptr<Scratch> make_scratch(int64_t D, int64_t D32) {
  auto w = std::make_unique<Scratch>();
  w->qb.assign(kHeads * D32 * 16, 0);
  w->acc.resize(kHeads * D * 16);
  return w;
}

// Items of (KV head, group of up to kHeads of its query heads, query block), taken one at a time from
// `next` until none is left, on the calling thread (its tiles configured here). A KV head's items go
// out together (its K / V tiles stay in cache; taking the heads in turn cost a 1,000-token chunk after
// its prefix 3.4 -> 4.1 ms), later query blocks first: they see more keys. Split in two static halves,
// a fresh 2,048-token prompt's thread with the later blocks of the middle KV head did ~1.4x the other's
// work (8.5 / 6.5 ms torch / ours -> 8.8 / 5.2). `keys`: every KV head's key tiles ([KVH][Tp / 16],
// key_tiles), `values` their packed V^T tiles.
TA_TARGET inline void run_items(const Problem& pr, std::atomic<int64_t>& next, const uint16_t* const* keys, KeyLayout kl,
                                const uint16_t* values, int64_t Tp, int64_t D32, Scratch& w) {
  configure();
  const int64_t blocks = (pr.Q + kRows - 1) / kRows, group = pr.H / pr.KVH, parts = (group + kHeads - 1) / kHeads;
  for (int64_t item = next++; item < pr.KVH * parts * blocks; item = next++) {
    const int64_t qb = blocks - 1 - item % blocks, part = item / blocks % parts, g = item / blocks / parts;
    const int64_t h0 = g * group + part * kHeads, R = std::min(kHeads, group - part * kHeads);
    const uint16_t* const* k = keys + g * (Tp / 16);
    const uint16_t* v = values + g * Tp * pr.D;
    if (R == 4) query_block<4>(pr, h0, qb, k, kl, v, D32, w);
    else if (R == 3) query_block<3>(pr, h0, qb, k, kl, v, D32, w);
    else if (R == 2) query_block<2>(pr, h0, qb, k, kl, v, D32, w);
    else query_block<1>(pr, h0, qb, k, kl, v, D32, w);
  }
  _tile_release();
}

// The whole call: every KV head's key tiles and packed values, then every item, on every thread.
inline void attend(const Problem& pr) {
  const int64_t Tp = round_up(pr.T, 64), D32 = round_up(pr.D, 32);
  std::vector<uint16_t> keys(keys_in_place(pr) ? 0 : pr.KVH * Tp * D32), values(pr.KVH * Tp * pr.D);
  std::vector<const uint16_t*> tiles(pr.KVH * Tp / 16);
  at::parallel_for(0, pr.KVH * 2, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (t % 2 == 0) key_tiles(pr, t / 2, Tp, D32, keys.data() + (keys.empty() ? 0 : t / 2 * Tp * D32), tiles.data() + t / 2 * Tp / 16);
      else pack_values(pr, t / 2, Tp, values.data() + t / 2 * Tp * pr.D);
    }
  });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) run_items(pr, next, tiles.data(), key_layout(pr), values.data(), Tp, D32, *make_scratch(pr.D, D32));
  });
}

#endif  // TM_AMX_COMPILES

}  // namespace tm_flash
