#pragma once
// Cache readers: how one slot's row of K or V (one token, one KV head) becomes fp32 lanes. The
// attention skeletons (paged_attention_rows.h, paged_attention_runs.h) are written once over a reader
// R, so a new cache format is one reader here (and its writer in fused_ops.h), not a copy of a kernel.
// The row formats are tokenmill/model/kv_cache_format.py's.
//
// A reader has: Elem, the cache tensor's element type; kExtra, elements a row holds beside its
// head_dim values; kRotated, whether rows hold H x (kv_rotation.h: the skeletons then rotate each
// query vector on its way in and each output vector on its way out, head dims 16-256); Row and
// row(p), the row starting at p (pointer arithmetic on rows is in Elem); lanes<W>(row, i), values
// i..i+W-1 as a vector of W floats; at(row, i), one value.

#include "kv_cache_format.h"
#include "paged_attention_common.h"

#include <utility>

namespace tm_attention {
namespace {

struct F32Rows {
  using Elem = float;
  static constexpr int64_t kExtra = 0;
  static constexpr bool kRotated = false;
  using Row = const float*;
  static TM_INLINE Row row(const float* p) { return p; }
  template <int W>
  static TM_INLINE Vec<W> lanes(Row r, int64_t i) { return loadv<W>(r + i); }
  static TM_INLINE float at(Row r, int64_t i) { return r[i]; }
};

struct Bf16Rows {  // bf16 -> fp32 is a 16-bit shift into the high half
  using Elem = uint16_t;
  static constexpr int64_t kExtra = 0;
  static constexpr bool kRotated = false;
  using Row = const uint16_t*;
  static TM_INLINE Row row(const uint16_t* p) { return p; }
  template <int W>
  static TM_INLINE Vec<W> lanes(Row r, int64_t i) {
    if constexpr (W == 16) {
      v16h h;
      std::memcpy(&h, r + i, sizeof(h));
      return reinterpret_cast<v16f>(__builtin_convertvector(h, v16u) << 16);
    } else {
      v8h h;
      std::memcpy(&h, r + i, sizeof(h));
      return reinterpret_cast<v8f>(__builtin_convertvector(h, v8u) << 16);
    }
  }
  static TM_INLINE float at(Row r, int64_t i) { return std::bit_cast<float>(static_cast<uint32_t>(r[i]) << 16); }
};

// int8: the row's fp32 scale (4 bytes, first), then head_dim codes; value = code * scale, a value of
// H x (kv_rotation.h; kRotated: lanes() gives the stored, rotated values). The scale
// is applied to each widened vector: one multiply per W values, which the grouped and run skeletons
// pay once per row for all the query heads that share it.
// int8 lanes -> int32 lanes, written as a lane list: GCC turns that into one vpmovsxbd, where it
// lowers __builtin_convertvector from int8 (to int32 or float) lane by lane (checked in the assembly).
template <typename C, size_t... I>
TM_INLINE auto widen_codes(C c, std::index_sequence<I...>) {
  return VecI<sizeof...(I)>{c[I]...};
}

struct Int8Rows {
  using Elem = int8_t;
  static constexpr int64_t kExtra = tm_kv::kInt8ScaleBytes;
  static constexpr bool kRotated = true;
  struct Row {
    const int8_t* codes;
    float scale;
  };
  static TM_INLINE Row row(const int8_t* p) {
    float s;
    std::memcpy(&s, p, sizeof(s));
    return {p + kExtra, s};
  }
  template <int W>
  static TM_INLINE Vec<W> lanes(Row r, int64_t i) {
    using C = std::conditional_t<W == 16, v16c, v8c>;
    C c;
    std::memcpy(&c, r.codes + i, sizeof(c));
    return __builtin_convertvector(widen_codes(c, std::make_index_sequence<W>{}), Vec<W>) * r.scale;
  }
  static TM_INLINE float at(Row r, int64_t i) { return static_cast<float>(r.codes[i]) * r.scale; }
};

using tm_kv::CacheFormat;

// Bytes spanned by a page's rows for one KV head (rows are slot_stride apart; hd values and the
// extras of each are read): what the prefetch of a page covers.
template <typename R>
TM_INLINE int64_t page_span_bytes(int64_t page_size, int64_t slot_stride, int64_t hd) {
  return ((page_size - 1) * slot_stride + R::kExtra + hd) * static_cast<int64_t>(sizeof(typename R::Elem));
}

}  // namespace
}  // namespace tm_attention
