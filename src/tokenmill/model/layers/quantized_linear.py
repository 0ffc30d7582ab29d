"""A linear layer whose weight stays quantized in memory (model/quant.py), with a kernel per row count.

Few rows (decode): the C++ kernel reads the packed codes directly, so a token costs the quantized
bytes, not fp32 ones: batch-1 decode is bound by the bytes of weights read. Many rows (prefill,
large decode batches): the weight is dequantized to bf16 into a temporary and multiplied by oneDNN's
bf16 GEMM, which on AVX512-BF16 runs at several times the FLOP rate of any matrix-vector kernel; the
dequantization is paid once per call and amortised over the rows, and the temporary is freed after
the call, so the resident weight stays the packed one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model.kernels import quant_kernel
from tokenmill.model.quant import QuantizedWeight

# Measured with SmolLM2-135M's shapes, all 30 layers streamed, 2 threads (docs/benchmarks.md): the
# packed kernel wins clearly up to ~8 rows; from 16 rows dequantize + bf16 GEMM is as fast or faster.
DENSE_MIN_ROWS = 12


class QuantizedLinear:
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dense_min_rows: int = DENSE_MIN_ROWS):
        self.weight = weight
        self.bias = bias
        self.dense_min_rows = dense_min_rows
        self.kernel = quant_kernel.available()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and x.shape[0] < self.dense_min_rows:
            out = quant_kernel.linear(x, self.weight)
        else:
            w = quant_kernel.dequantize(self.weight) if self.kernel else self.weight.dequantize(torch.bfloat16)
            out = F.linear(x.to(torch.bfloat16), w).float()
        return out if self.bias is None else out.add_(self.bias)

    def describe(self) -> str:
        path = f"packed kernel below {self.dense_min_rows} rows, bf16 GEMM above" if self.kernel else "bf16 GEMM"
        return f"{self.weight.kind} ({self.weight.bits}-bit, {path})"


class QuantizedEmbedding:
    """Embedding lookup that dequantizes only the rows of the tokens in the batch."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids).dequantize(torch.float32)
