#pragma once
// The KV cache formats the kernels read (kv_cache_rows.h) and the fused ops write (fused_ops.h), told
// apart by the cache tensor's dtype: rows of fp32 or bf16 values, or int8 rows (a 4-byte fp32 scale,
// then head_dim codes of H x, kv_rotation.h). The format is defined once, in
// tokenmill/model/kv_cache_format.py.

#include "kv_rotation.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tm_kv {

enum CacheFormat { kCacheF32 = 0, kCacheBf16 = 1, kCacheInt8 = 2 };

constexpr int64_t kInt8ScaleBytes = 4;  // the fp32 scale at the start of an int8 row

inline CacheFormat cache_format(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return kCacheBf16;
  if (dtype == at::kChar) return kCacheInt8;
  TORCH_CHECK(dtype == at::kFloat, "the KV cache must be float32, bfloat16 or int8 (rows with a scale)");
  return kCacheF32;
}

// Elements of one row (one token, one KV head) of a cache with head_dim hd.
inline int64_t row_width(CacheFormat format, int64_t hd) { return hd + (format == kCacheInt8 ? kInt8ScaleBytes : 0); }

}  // namespace tm_kv
