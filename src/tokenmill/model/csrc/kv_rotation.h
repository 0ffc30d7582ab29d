#pragma once
// The rotation of int8 K/V rows (tokenmill/model/kv_cache_format.py). An int8 row holds the codes of
// H x, where H is the orthonormal Walsh-Hadamard matrix of the head dim: keys carry a few channels
// far larger than the rest, and one scale per row (max|x| / 127) leaves the small channels a few
// levels; H spreads every channel over all of them, so the row's maximum is near its typical value.
// H is symmetric and orthonormal, so attention never rotates the cache back: q . k = (H q) . (H k),
// and sum_t w_t v_t = H (sum_t w_t H v_t). The kernels rotate each query vector once on its way in
// and each output vector once on its way out (kv_cache_rows.h, kRotated: `hadamard`, inlined); the
// writer rotates a row before rounding it (fused_ops.h: `rotate`). Head dims 16-256 that are powers
// of two rotate; others do not.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tm_kv {

inline constexpr bool rotates(int64_t hd) { return hd == 16 || hd == 32 || hd == 64 || hd == 128 || hd == 256; }

// x <- H x for N values (16 <= N, a power of two): butterflies (a, b) -> (a + b, a - b) at strides 1,
// 2, ..., N / 2 (the Sylvester order, H[i][j] = (-1)^popcount(i & j) / sqrt(N)), then the 1 / sqrt(N)
// scale, on vectors of 16 floats. Strides under 16 pair lanes of one vector: y = x * sign + x[lane ^ h]
// (sign -1 where lane & h) is a + b in the lower lane and a - b in the upper, exactly (a product by
// +-1 is exact), so the result is the plain loops' to the bit (kv_cache_format.py's `rotate` too).
// Always inlined: the kernels call it inside their AVX-512 variants (target attributes), and an
// inline function without that attribute would be a call to its baseline copy there (~40 ns a
// vector of 64 against ~8; a 16-row prompt run 15 % slower). Through `rotate` below (one copy per
// target, picked at run time), a run of 16 rows measured 8-12 % slower than inlined.
template <int N>
inline __attribute__((always_inline)) void hadamard(float* __restrict x) {
  typedef float v16 __attribute__((vector_size(64)));
  constexpr int M = N / 16;
  v16 v[M];
  for (int i = 0; i < M; ++i) std::memcpy(&v[i], x + 16 * i, sizeof(v16));
  const v16 s1 = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
  const v16 s2 = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1};
  const v16 s4 = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1};
  const v16 s8 = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
  for (int i = 0; i < M; ++i) {
    v16 y = v[i];
    y = y * s1 + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    y = y * s2 + __builtin_shufflevector(y, y, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    y = y * s4 + __builtin_shufflevector(y, y, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    y = y * s8 + __builtin_shufflevector(y, y, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v[i] = y;
  }
  for (int h = 1; h < M; h *= 2)
    for (int i = 0; i < M; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const v16 a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
  const float s = 1.0f / std::sqrt(static_cast<float>(N));
  for (int i = 0; i < M; ++i) {
    v[i] *= s;
    std::memcpy(x + 16 * i, &v[i], sizeof(v16));
  }
}

// hadamard for a head dim known at run time (rotates(n) must hold), inlined into the two copies below.
inline __attribute__((always_inline)) void hadamard(float* x, int64_t n) {
  switch (n) {
    case 16: hadamard<16>(x); break;
    case 32: hadamard<32>(x); break;
    case 64: hadamard<64>(x); break;
    case 128: hadamard<128>(x); break;
    default: hadamard<256>(x); break;
  }
}

// What the writer calls (a few rows a token): one AVX-512 copy and one baseline copy, the caller's
// pick, whatever target the caller itself was compiled for.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((noinline, target("arch=x86-64-v4,prefer-vector-width=512"))) inline void rotate_avx512(float* x, int64_t n) {
  hadamard(x, n);
}
#endif
__attribute__((noinline)) inline void rotate_base(float* x, int64_t n) { hadamard(x, n); }

// x <- H x for head dim n (rotates(n) must hold); `wide`: the caller's check that the CPU has AVX-512
// (fused_ops.h's use_avx512).
inline void rotate(float* x, int64_t n, bool wide) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (wide) return rotate_avx512(x, n);
#endif
  rotate_base(x, n);
}

}  // namespace tm_kv
