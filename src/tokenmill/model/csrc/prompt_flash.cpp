// The prompt attention op on AMX tiles (the kernel: prompt_flash_amx.h; its K/V tiles read from the
// cache's pages: prompt_flash_pack.h).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

#include "prompt_flash_amx.h"

namespace {

// The cache's rows of positions 0 .. kv_len - 1 through `pages`, checked: a bad page is an error, not a
// wild read.
tm_flash::PagedRows paged_rows(const at::Tensor& cache, const at::Tensor& pages, int64_t kv_len, int64_t page_size,
                               bool unrotate) {
  const bool int8 = cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || cache.scalar_type() == at::kBFloat16, "k_cache and v_cache must be bfloat16 or int8 caches");
  const int64_t pool_pages = cache.size(1) / page_size, used = (kv_len + page_size - 1) / page_size;
  TORCH_CHECK(pages.size(0) >= used, "pages holds ", pages.size(0), " pages; ", kv_len, " keys need ", used);
  const int64_t* ids = pages.data_ptr<int64_t>();
  for (int64_t p = 0; p < used; ++p)
    TORCH_CHECK(ids[p] >= 0 && ids[p] < pool_pages, "pages[", p, "] = ", ids[p], " is outside the cache's ", pool_pages,
                " pages");
  const int64_t elem = cache.element_size();
  return {reinterpret_cast<const uint8_t*>(cache.data_ptr()), cache.stride(0) * elem, cache.stride(1) * elem, ids,
          page_size, int8, unrotate};
}

// q [Q, H, D] at the last Q positions of kv_len keys whose K / V rows lie in the caches [KVH, slots,
// row] at `pages` (page_size slots each): query i sees keys 0 .. kv_len - Q + i, or every key where
// not `causal`. `out`, if given, is written instead of a new tensor; `stats` ([Q, H, 2] float32), if
// given, gets each query's softmax max (of the scaled scores) and sum.
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& pages_in, int64_t kv_len, int64_t page_size, double scale, bool bf16_out,
                            bool unrotate, const std::optional<at::Tensor>& out_in, bool causal,
                            const std::optional<at::Tensor>& stats) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1,
              "q must be a bfloat16 [Q, H, D] tensor with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && k_cache.stride(2) == 1,
              "k_cache and v_cache must be caches of one shape, strides and dtype, [KVH, slots, row], rows contiguous");
  TORCH_CHECK(tm_amx::amx_ready(), "this process cannot run AMX-BF16 tiles");
  const int64_t Q = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0);
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(tm_flash::takes_head_dim(D), "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(k_cache.size(2) == tm_kv::row_width(int8 ? tm_kv::kCacheInt8 : tm_kv::kCacheBf16, D),
              "head_dim of q and the caches' rows differ");
  TORCH_CHECK(!unrotate || (int8 && tm_kv::rotates(D)), "unrotate is for int8 rows of a head dim that rotates");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "the query heads must be a multiple of the KV heads");
  TORCH_CHECK(!causal || Q <= kv_len, "more queries than keys: the queries are the context's last positions");
  TORCH_CHECK(kv_len > 0 || Q == 0, "queries need at least one key");
  TORCH_CHECK(!stats.has_value() || (stats->dim() == 3 && stats->size(0) == Q && stats->size(1) == H &&
                                     stats->size(2) == 2 && stats->scalar_type() == at::kFloat && stats->is_contiguous()),
              "stats must be a contiguous float32 [Q, H, 2] tensor");
  TORCH_CHECK(page_size > 0 && scale > 0, "page_size and scale must be positive");
  const at::Tensor pages = pages_in.to(at::kLong).contiguous();
  TORCH_CHECK(pages.dim() == 1, "pages must be 1-d");
  const auto out_dtype = bf16_out ? at::kBFloat16 : at::kFloat;
  at::Tensor out = out_in.has_value() ? *out_in : at::empty({Q, H, D}, q.options().dtype(out_dtype));
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == out_dtype && out.is_contiguous(),
              "out must be a contiguous [Q, H, D] tensor of the output dtype");
  if (Q == 0) return out;
  tm_flash::Problem pr{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
                       paged_rows(k_cache, pages, kv_len, page_size, unrotate),
                       paged_rows(v_cache, pages, kv_len, page_size, unrotate), out.data_ptr(), bf16_out, Q, kv_len, H,
                       KVH, D, static_cast<float>(scale)};
  pr.causal = causal;
  if (stats.has_value()) pr.stats = stats->data_ptr<float>();
#if TM_AMX_COMPILES
  tm_flash::attend(pr);
#endif
  return out;
}

bool available() { return tm_amx::amx_ready(); }

}  // namespace

TORCH_LIBRARY(tokenmill_flash, m) {
  m.def(
      "prompt_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor pages, int kv_len, int page_size, float scale, "
      "bool bf16_out=False, bool unrotate=False, Tensor(a!)? out=None, bool causal=True, Tensor(b!)? stats=None) -> Tensor",
      &prompt_attention);
  m.def("available() -> bool", &available);
}
