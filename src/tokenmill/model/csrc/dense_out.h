#pragma once
// The caller's buffer for a whole weight dequantized to a dense [N, K] matrix (the `*_into` ops of
// quant_vnni.cpp, quant_avx2.cpp, quant_linear.cpp): a prompt step's GEMM reads such a copy of every
// weight, and a fresh one each time costs a page fault per 4 kB (model/kernels/weight_scratch.py).

#include <ATen/core/Tensor.h>

namespace tm_dense {

inline void check_dense_out(const at::Tensor& out, int64_t N, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(out.scalar_type() == dtype, "out must be ", dtype, ", got ", out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
              "out must be a contiguous [", N, ", ", K, "] tensor, got ", out.sizes(),
              out.is_contiguous() ? "" : " (not contiguous)");
}

}  // namespace tm_dense
