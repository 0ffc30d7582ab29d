#pragma once
// A blocked weight's tensors (codes, scales, mins, subs; model/blocked_formats.py) checked against
// its format and shape, as every kernel over the layout takes them (quant_vnni.h, quant_avx2.h).

#include <ATen/core/Tensor.h>

#include "quant_blocks.h"

namespace tm_vnni {

// A blocked weight's tensors in format `fmt` as the kernels see them, checked against [N, K].
inline Weights check_shapes(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& subs,
                            int64_t fmt, int64_t N, int64_t K) {
  const int bits = fmt_bits(static_cast<int>(fmt));
  TORCH_CHECK(bits > 0, "unknown blocked format ", fmt);
  const int64_t width = kGroup * fmt_scale_groups(static_cast<int>(fmt));  // inputs a scale record covers
  TORCH_CHECK(N % kCols == 0 && K % width == 0, "N must be a multiple of 16 and K of ", width);
  const int64_t G = K / kGroup, per_col = K / width;
  TORCH_CHECK(codes.is_contiguous() && codes.numel() == N * K * bits / 8 && codes.element_size() == 1,
              "codes do not match [N/16, G, bits * 64] for this N and K");
  const int64_t fp16_scales = fmt_fp16_scales(static_cast<int>(fmt)) ? N * per_col : 0;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf && scales.numel() == fp16_scales,
              "scales must be float16 [N/16, K / inputs a scale covers, 16]");
  const int min_rule = fmt_mins(static_cast<int>(fmt));
  TORCH_CHECK(min_rule > 0 || mins.numel() == 0, "this format has no mins");
  TORCH_CHECK(min_rule < 2 || mins.numel() > 0, "this format needs mins");
  if (mins.numel() > 0) {
    TORCH_CHECK(mins.is_contiguous() && mins.scalar_type() == at::kHalf && mins.numel() == N * per_col,
                "mins must be float16 like scales, or empty");
  }
  const bool has_subs = fmt_has_subs(static_cast<int>(fmt));
  if (has_subs) {
    TORCH_CHECK(subs.is_contiguous() && subs.element_size() == 1 &&
                    subs.numel() == N * per_col * fmt_subs(static_cast<int>(fmt)),
                "subs must be uint8 [N/16, scale records, bytes each, 16]");
  }
  Weights w{};
  w.codes = static_cast<const uint8_t*>(codes.data_ptr());
  w.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  w.mins = mins.numel() > 0 ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  w.subs = has_subs ? static_cast<const uint8_t*>(subs.data_ptr()) : nullptr;
  w.G = G;
  w.fmt = static_cast<int>(fmt);
  w.bits = bits;
  return w;
}

}  // namespace tm_vnni
