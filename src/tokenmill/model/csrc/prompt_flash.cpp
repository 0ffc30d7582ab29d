// The prompt attention op on AMX tiles (the kernel: prompt_flash_amx.h).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "prompt_flash_amx.h"

namespace {

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kBFloat16 && t.stride(2) == 1, name,
              " must be a bfloat16 3-d tensor with contiguous rows");
}

// q [Q, H, D] at the last Q positions of k, v [KVH, T, D]: query i sees keys 0 .. T - Q + i.
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool bf16_out) {
  check_bf16(q, "q");
  check_bf16(k, "k");
  check_bf16(v, "v");
  TORCH_CHECK(tm_amx::amx_ready(), "this process cannot run AMX-BF16 tiles");
  const int64_t Q = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(0), T = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have the same shape");
  TORCH_CHECK(k.size(2) == D, "head_dim of q and k differ");
  TORCH_CHECK(D > 0 && D % 16 == 0, "head_dim must be a positive multiple of 16");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "the query heads must be a multiple of the KV heads");
  TORCH_CHECK(Q <= T, "more queries than keys: the queries are the context's last positions");
  TORCH_CHECK(scale > 0, "scale must be positive");
  at::Tensor out = at::empty({Q, H, D}, q.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (Q == 0) return out;
#if TM_AMX_COMPILES
  const auto bf16 = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  tm_flash::Problem pr{bf16(q), q.stride(0), q.stride(1), bf16(k), k.stride(0), k.stride(1), bf16(v), v.stride(0),
                       v.stride(1), out.data_ptr(), bf16_out, Q, T, H, KVH, D, static_cast<float>(scale)};
  tm_flash::attend(pr);
#endif
  return out;
}

bool available() { return tm_amx::amx_ready(); }

}  // namespace

TORCH_LIBRARY(tokenmill_flash, m) {
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, float scale, bool bf16_out=False) -> Tensor", &prompt_attention);
  m.def("available() -> bool", &available);
}
