"""A linear layer whose weight stays quantized in memory (model/quant.py), with a kernel per CPU.

On AVX512-VNNI CPUs the weight is re-laid once into column blocks (`to_blocked`, or the loader's
`to_blocked_gguf` for every GGUF block type in KERNEL_TYPES: K-quants, Q5, IQ4 in their own bits)
and calls run csrc/quant_vnni.h: measured with SmolLM2's shapes, all 30 layers streamed, 2 threads, it reads Q4
weights at ~20 GB/s for one row (3.2 ms a token). From BLOCKED_DENSE_MIN_ROWS rows (prefill chunks)
the blocked weight is dequantized to a temporary bf16 matrix (10 ms for all 30 layers) for oneDNN's
GEMM: 2048 rows 1.27 s vs 1.58 s. That speed costs precision: the weights, activations and outputs are
rounded to bf16 there, and on the held-out text it is ~90% of the fast path's KL to exact (prompt
steps on the two-term VNNI kernel: KL 10x lower for ~13% more CPU, docs/benchmarks.md "Where the
fast path's disagreement comes from"), more for formats with more bits per code: so the choice is per
format (`prompt_gemm_for`: Q4_1, Q4_K, IQ4 on bf16, the others on the kernel), or the engine's setting.
Elsewhere the row-layout kernel (csrc/quant_linear.cpp) runs few rows, and many rows dequantize the weight to a temporary bf16 matrix for oneDNN's GEMM (paid
once per call, amortised over the rows; the temporary is freed after the call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model.kernels import quant_kernel
from tokenmill.model.quant import BlockedWeight, QuantizedWeight, to_blocked
from tokenmill.model.quant_formats import FORMATS
from tokenmill.model.quantization_modes import PROMPT_GEMMS

# Blocked (VNNI) weights: 2-term VNNI vs dequantize + bf16 GEMM, 30 layers, 2 threads: 128 rows 95 vs
# 97 ms, 256 rows 194 vs 158 ms. Steps of fewer rows are decode steps (the fused decode step's limit).
BLOCKED_DENSE_MIN_ROWS = 192
# How blocked weights run steps of BLOCKED_DENSE_MIN_ROWS+ rows (prompts): "vnni", the two-term kernel
# on the file's own values, "bf16", dequantize + oneDNN's bf16 GEMM, or "auto", per format
# (`prompt_gemm_for`). The engine setting `prompt_gemm` (EngineConfig, --prompt-gemm) picks one.
# "auto": a GGUF type's own choice (quant_formats/registry.py `bf16_prompt`, measured per format);
# weights quantized at load (int4 / int8) by bits per code, bf16 for at most this many.
BF16_PROMPT_MAX_BITS = 4
# Row-layout kernel only (no VNNI). Measured with SmolLM2-135M's shapes, all 30 layers streamed, 2 threads (docs/benchmarks.md): the
# packed kernel wins clearly up to ~8 rows; from 16 rows dequantize + bf16 GEMM is as fast or faster.
DENSE_MIN_ROWS = 12
# dense_min_rows for a layer that must always run the packed kernel (the lm_head: fp32 logits).
NEVER_DENSE = 1 << 62


def prompt_gemm_for(weight: QuantizedWeight | BlockedWeight, setting: str = "auto") -> str:
    """How `weight`'s prompt steps run: `setting` itself, or for "auto" bf16 when every GGUF type the
    weight holds allows it (registry `bf16_prompt`; "Q4_0+Q4_1" for a stacked one), or for weights
    quantized at load when its codes have at most BF16_PROMPT_MAX_BITS bits, and the VNNI kernel
    otherwise. Row-layout weights (no VNNI) always take the bf16 GEMM for many rows."""
    if setting not in PROMPT_GEMMS:
        raise ValueError(f"prompt_gemm must be one of {PROMPT_GEMMS}, got {setting!r}")
    if setting != "auto":
        return setting
    kinds = weight.kind.split("+")
    if all(k in FORMATS for k in kinds):
        return "bf16" if all(FORMATS[k].bf16_prompt for k in kinds) else "vnni"
    return "bf16" if weight.bits <= BF16_PROMPT_MAX_BITS else "vnni"


class QuantizedLinear:
    def __init__(self, weight: QuantizedWeight | BlockedWeight, bias: torch.Tensor | None,
                 dense_min_rows: int = DENSE_MIN_ROWS, prompt_gemm: str = "auto"):
        if isinstance(weight, QuantizedWeight) and weight.shape[0] % 16 == 0 and quant_kernel.vnni_available():
            weight = to_blocked(weight)
        prompt_gemm = prompt_gemm_for(weight, prompt_gemm)
        self.weight = weight
        self.bias = bias
        self.dense_min_rows = dense_min_rows
        self.kernel = quant_kernel.available()
        # Decode calls this 121 times a token: the VNNI call is bound once here, not rebuilt per call
        # through wrappers (~3 us a call, ~6% of a batch-1 step).
        self._vnni = quant_kernel.bound_blocked_linear(weight) if isinstance(weight, BlockedWeight) else None
        self._vnni_rows = max(dense_min_rows, BLOCKED_DENSE_MIN_ROWS) if prompt_gemm == "bf16" else NEVER_DENSE

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._vnni is not None and x.shape[0] < self._vnni_rows and self.bias is None:
            return self._vnni(x)
        if isinstance(self.weight, BlockedWeight):
            if x.shape[0] >= self._vnni_rows:
                w = quant_kernel.blocked_dequantize_bf16(self.weight)
                out = F.linear(x.to(torch.bfloat16), w)
                # bf16 in, bf16 out: the caller's fused ops read and write bf16 (no conversion passes)
                if x.dtype == torch.bfloat16 and self.bias is None:
                    return out
                out = out.float()
            else:
                out = quant_kernel.blocked_linear(x, self.weight)
        elif self.kernel and x.shape[0] < self.dense_min_rows:
            out = quant_kernel.linear(x, self.weight)
        else:
            w = quant_kernel.dequantize(self.weight) if self.kernel else self.weight.dequantize(torch.bfloat16)
            out = F.linear(x.to(torch.bfloat16), w).float()
        return out if self.bias is None else out.add_(self.bias)

    def runs_vnni(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs the VNNI kernel on a float32 input, as it comes."""
        return self._vnni is not None and rows < self._vnni_rows and self.bias is None

    @property
    def vnni_weight(self) -> BlockedWeight | None:
        """The column-blocked weight when calls below BLOCKED_DENSE_MIN_ROWS rows run the VNNI kernel
        (what the fused decode step runs too), else None."""
        return self.weight if self._vnni is not None and self.bias is None else None

    @property
    def bf16_from_rows(self) -> int | None:
        """From how many rows a bf16 input gives a bf16 output (the dequantize + bf16 GEMM path), or
        None where the layer always returns float32."""
        if isinstance(self.weight, BlockedWeight) and self.bias is None and self._vnni_rows < NEVER_DENSE:
            return self._vnni_rows
        return None

    def describe(self) -> str:
        if isinstance(self.weight, BlockedWeight):
            path = "column-blocked AVX512-VNNI kernel, activations as two int8 terms"
            if self._vnni_rows < NEVER_DENSE:
                path += f"; bf16 GEMM from {self._vnni_rows} rows"
            return f"{self.weight.kind} ({self.weight.bits}-bit, {path})"
        path = f"packed kernel below {self.dense_min_rows} rows, bf16 GEMM above" if self.kernel else "bf16 GEMM"
        return f"{self.weight.kind} ({self.weight.bits}-bit, {path})"


class QuantizedEmbedding:
    """Embedding lookup that dequantizes only the rows of the tokens in the batch."""

    def __init__(self, weight: QuantizedWeight | BlockedWeight) -> None:
        self.weight = weight  # blocked when it is shared with a tied lm_head that runs the VNNI kernel

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, BlockedWeight):
            return quant_kernel.blocked_rows(self.weight, ids)
        return self.weight.rows(ids).dequantize(torch.float32)
