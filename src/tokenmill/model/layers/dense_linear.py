"""A dense linear layer that can run its big GEMMs in bf16 while staying fp32 everywhere else.

On AVX512-BF16 CPUs a large bf16 matmul is ~4x faster than fp32, but a bf16 matrix-vector product
is slower than fp32. So in fast mode a layer keeps both copies of an fp32 weight and picks per call
by the number of rows; in exact mode (the fidelity tests) only fp32 exists. A 16-bit weight (a GGUF
F16 / BF16 matrix, or one dequantized to bf16 because its type has no kernel) is the only copy: few
rows multiply its exact values in fp32 a slab of rows at a time (a small temporary, never a whole
fp32 copy), many rows run the bf16 GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Output rows upcast per slab on the 16-bit path: 1024 x 576 fp32 is 2.4 MB, within L2/L3.
_SLAB = 1024


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bf16_min_rows: int | None) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.bf16_min_rows = bf16_min_rows
        if self.weight.dtype == torch.float32:
            self.weight_bf16 = self.weight.to(torch.bfloat16) if bf16_min_rows is not None else None
        else:
            self.weight_bf16 = self.weight if self.weight.dtype == torch.bfloat16 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        big = self.bf16_min_rows is not None and x.shape[0] >= self.bf16_min_rows
        if big and (self.weight_bf16 is not None or self.weight.dtype != torch.float32):
            w = self.weight_bf16 if self.weight_bf16 is not None else self.weight.to(torch.bfloat16)
            out = F.linear(x.to(torch.bfloat16), w).float()
            return out if self.bias is None else out.add_(self.bias)
        if self.weight.dtype != torch.float32:
            return self._upcast(x.float())
        return F.linear(x, self.weight, self.bias)

    def _upcast(self, x: torch.Tensor) -> torch.Tensor:
        n = self.weight.shape[0]
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        for start in range(0, n, _SLAB):
            out[:, start : start + _SLAB] = F.linear(x, self.weight[start : start + _SLAB].float())
        return out if self.bias is None else out.add_(self.bias)

    def describe(self) -> str:
        if self.weight.dtype != torch.float32:
            return f"{str(self.weight.dtype).removeprefix('torch.')} (fp32 slabs below {self.bf16_min_rows} rows)"
        if self.weight_bf16 is None:
            return "fp32"
        return f"fp32, bf16 GEMM from {self.bf16_min_rows} rows"
