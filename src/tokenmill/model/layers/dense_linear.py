"""A dense linear layer that can run its big GEMMs in bf16 while staying fp32 everywhere else.

On AVX512-BF16 CPUs a large bf16 matmul is ~4x faster than fp32, but a bf16 matrix-vector product
is slower than fp32. So in fast mode a layer keeps both copies of its weight and picks per call by
the number of rows; in exact mode (the fidelity tests) only fp32 exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bf16_min_rows: int | None) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.bf16_min_rows = bf16_min_rows
        self.weight_bf16 = self.weight.to(torch.bfloat16) if bf16_min_rows is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_bf16 is not None and x.shape[0] >= self.bf16_min_rows:
            out = F.linear(x.to(torch.bfloat16), self.weight_bf16).float()
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    def describe(self) -> str:
        if self.weight_bf16 is None:
            return "fp32"
        return f"fp32, bf16 GEMM from {self.bf16_min_rows} rows"
