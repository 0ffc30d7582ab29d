"""A linear layer whose weight stays quantized in memory (model/quant.py), with a kernel per CPU.

Where a column-blocked kernel runs (AVX512-VNNI: csrc/quant_vnni.h; AVX2: csrc/quant_avx2.h), the weight
is re-laid once into column blocks (`to_blocked`, or the loader's `to_blocked_gguf` for every GGUF
block type in KERNEL_TYPES: K-quants, Q5, IQ4 in their own bits). Measured with SmolLM2's shapes, all
30 layers streamed, 2 threads, the VNNI kernel reads Q4 weights at ~20 GB/s for one row (3.2 ms a
token). Prompt steps (many rows) take one of three paths (`prompt_gemm_for`):
- "bf16": from BLOCKED_DENSE_MIN_ROWS rows the weight is dequantized to a temporary bf16 matrix (10 ms
  for all 30 layers) for oneDNN's GEMM: 2048 rows 1.27 s vs 1.58 s on the kernel. That speed costs
  precision: weights, activations and outputs are rounded to bf16, ~90% of the fast path's KL to exact
  on the held-out text (docs/benchmarks.md "Where the fast path's disagreement comes from"), more for
  formats with more bits per code; so under "auto" the choice is per format. Only where the CPU
  multiplies bf16 natively (kernels/cpu_isa.py): elsewhere oneDNN emulates it at a fifth of fp32's speed.
- "vnni": the blocked kernel at every row count, on the file's own values (two int8 terms).
- "fp32": from AVX2_DENSE_MIN_ROWS rows the weight is dequantized to a temporary fp32 matrix for an fp32
  GEMM: "auto" on AVX2 CPUs (VNNI ones without native bf16 run their kernel at every row count).
  docs/benchmarks.md, "AVX2": the AVX2 kernel wins at 64 rows, the GEMM from ~128 (a 512-token
  prompt of the bundled model's mixes: 575-633 against 492-556 tok/s on the kernel).
Elsewhere the row-layout kernel (csrc/quant_linear.cpp) runs few rows, and many rows dequantize the
weight to a temporary matrix (bf16 where native, else fp32) for oneDNN's GEMM (paid once per call,
amortised over the rows; the temporary is freed after the call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model.kernels import cpu_isa, fused_ops, quant_kernel
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
# prompt_gemm "fp32": from how many rows (the AVX2 kernel against dequantize + fp32 GEMM, 2 threads).
AVX2_DENSE_MIN_ROWS = 128
# Row-layout kernel only (no blocked kernel). Measured with SmolLM2-135M's shapes, all 30 layers streamed, 2 threads (docs/benchmarks.md): the
# packed kernel wins clearly up to ~8 rows; from 16 rows dequantize + bf16 GEMM is as fast or faster.
DENSE_MIN_ROWS = 12
# dense_min_rows for a layer that must always run the packed kernel (the lm_head: fp32 logits).
NEVER_DENSE = 1 << 62


def prompt_gemm_for(weight: QuantizedWeight | BlockedWeight, setting: str = "auto") -> str:
    """How `weight`'s prompt steps run: `setting` itself, or for "auto": where the CPU has no native
    bf16 GEMM, the VNNI kernel, or on AVX2 dequantize + fp32 GEMM; else bf16
    when every GGUF type the weight holds allows it (registry `bf16_prompt`; "Q4_0+Q4_1" for a stacked
    one), or for weights quantized at load when its codes have at most BF16_PROMPT_MAX_BITS bits, and
    the VNNI kernel otherwise. Row-layout weights take a dense GEMM for many rows whatever this says."""
    if setting not in PROMPT_GEMMS:
        raise ValueError(f"prompt_gemm must be one of {PROMPT_GEMMS}, got {setting!r}")
    if setting != "auto":
        return setting
    if not cpu_isa.bf16_gemm_native():
        return "vnni" if quant_kernel.blocked_kernel() == "vnni" else "fp32"
    kinds = weight.kind.split("+")
    if all(k in FORMATS for k in kinds):
        return "bf16" if all(FORMATS[k].bf16_prompt for k in kinds) else "vnni"
    return "bf16" if weight.bits <= BF16_PROMPT_MAX_BITS else "vnni"


class QuantizedLinear:
    def __init__(self, weight: QuantizedWeight | BlockedWeight, bias: torch.Tensor | None,
                 dense_min_rows: int = DENSE_MIN_ROWS, prompt_gemm: str = "auto", two_tile_terms: bool = False):
        if isinstance(weight, QuantizedWeight) and weight.shape[0] % 16 == 0 and quant_kernel.blocked_kernel():
            weight = to_blocked(weight)
        self.prompt_gemm = prompt_gemm_for(weight, prompt_gemm)
        self.weight = weight
        self.bias = bias
        self.dense_min_rows = dense_min_rows
        self.kernel = quant_kernel.available()
        # Decode calls this 121 times a token: the kernel call is bound once here, not rebuilt per call
        # through wrappers (~3 us a call, ~6% of a batch-1 step).
        self._blocked = (quant_kernel.bound_blocked_linear(weight, two_tile_terms=two_tile_terms)
                         if isinstance(weight, BlockedWeight) else None)
        gemm_from = {"bf16": BLOCKED_DENSE_MIN_ROWS, "fp32": AVX2_DENSE_MIN_ROWS}.get(self.prompt_gemm)
        self._gemm_rows = NEVER_DENSE if gemm_from is None else max(dense_min_rows, gemm_from)
        # A gate and up projection stacked (`silu_mul`): the activation in the AMX tiles' epilogue.
        self._silu_mul = (quant_kernel.bound_blocked_silu_mul(weight)
                          if self._blocked is not None and bias is None and not two_tile_terms else None)
        self._silu_mul_rows = quant_kernel.amx_min_rows() if self._silu_mul is not None else NEVER_DENSE
        # From how many rows the tiles read a bf16 input as it is (AMX: Q8_0, Q6_K; the vector tiles
        # without AMX: Q8_0; no conversion pass, the same results as its float32 values); None where no
        # call does.
        takes_bf16 = (self._blocked is not None and bias is None
                      and quant_kernel.tiles_take_bf16(weight, two_tile_terms=two_tile_terms))
        tiles_rows = quant_kernel.tiles_min_rows() if takes_bf16 else None
        self._tiles_bf16_rows = tiles_rows if tiles_rows is not None and tiles_rows < self._gemm_rows else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._blocked is not None and x.shape[0] < self._gemm_rows and self.bias is None:
            return self._blocked(x)
        if isinstance(self.weight, BlockedWeight):
            if x.shape[0] < self._gemm_rows:  # with a bias
                out = self._blocked(x)
            elif self.prompt_gemm == "fp32":
                out = F.linear(x.float(), quant_kernel.blocked_dense_scratch(self.weight, torch.float32))
            else:
                out = F.linear(x.to(torch.bfloat16), quant_kernel.blocked_dense_scratch(self.weight, torch.bfloat16))
                # bf16 in, bf16 out: the caller's fused ops read and write bf16 (no conversion passes)
                if x.dtype == torch.bfloat16 and self.bias is None:
                    return out
                out = out.float()
        elif self.kernel and x.shape[0] < self.dense_min_rows:
            out = quant_kernel.linear(x, self.weight)
        else:
            dtype = torch.bfloat16 if cpu_isa.bf16_gemm_native() else torch.float32
            w = quant_kernel.dense_scratch(self.weight, dtype) if self.kernel else self.weight.dequantize(dtype)
            out = F.linear(x.to(dtype), w).float()
        return out if self.bias is None else out.add_(self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's output [gate | up] (a gated MLP's stacked gate and up
        projections): fused into the AMX tiles' sums where they take the rows (neither half written out,
        no pass over them after), else fused_ops.silu_mul after the call."""
        if self._silu_mul_rows <= x.shape[0] < self._gemm_rows:  # a bf16 x gives bf16 (what down reads)
            return self._silu_mul(x)
        return fused_ops.silu_mul(self(x))

    def runs_kernel(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs the blocked kernel on a float32 input, as it comes."""
        return self.kernel_weight is not None and rows < self._gemm_rows

    @property
    def kernel_weight(self) -> BlockedWeight | None:
        """The column-blocked weight when calls of few rows run a blocked kernel (VNNI or AVX2), else None."""
        return self.weight if self._blocked is not None and self.bias is None else None

    @property
    def kernel_at_any_rows(self) -> bool:
        """Whether every call runs the blocked kernel (prompt_gemm "vnni"), never a dense GEMM."""
        return self._blocked is not None and self._gemm_rows == NEVER_DENSE

    @property
    def bf16_from_rows(self) -> int | None:
        """From how many rows a bf16 input gives a bf16 output (the dequantize + bf16 GEMM path), or
        None where the layer always returns float32."""
        if isinstance(self.weight, BlockedWeight) and self.bias is None and self.prompt_gemm == "bf16":
            return self._gemm_rows
        return None

    @property
    def bf16_input_from_rows(self) -> int | None:
        """From how many rows a bf16 input costs no conversion and changes nothing the layer would
        round anyway: bf16_from_rows, or the AMX tiles of a format that reads it as it is (float32
        out); None where calls convert it."""
        gemm = self.bf16_from_rows
        return gemm if gemm is not None else self._tiles_bf16_rows

    def describe(self) -> str:
        if isinstance(self.weight, BlockedWeight):
            isa = "AVX512-VNNI" if quant_kernel.blocked_kernel() == "vnni" else "AVX2"
            path = f"column-blocked {isa} kernel, activations as two int8 terms"
            if self._gemm_rows < NEVER_DENSE:
                path += f"; {self.prompt_gemm} GEMM from {self._gemm_rows} rows"
            return f"{self.weight.kind} ({self.weight.bits}-bit, {path})"
        dense = "bf16" if cpu_isa.bf16_gemm_native() else "fp32"
        path = f"packed kernel below {self.dense_min_rows} rows, {dense} GEMM above" if self.kernel else f"{dense} GEMM"
        return f"{self.weight.kind} ({self.weight.bits}-bit, {path})"


def gated_silu(gate_up, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a stacked gate / up linear's output [gate | up]: in the AMX tiles' epilogue
    where `gate_up` is a QuantizedLinear that takes it (QuantizedLinear.silu_mul), else
    fused_ops.silu_mul after the call."""
    if isinstance(gate_up, QuantizedLinear):
        return gate_up.silu_mul(x)
    return fused_ops.silu_mul(gate_up(x))


class QuantizedEmbedding:
    """Embedding lookup that dequantizes only the rows of the tokens in the batch."""

    def __init__(self, weight: QuantizedWeight | BlockedWeight) -> None:
        self.weight = weight  # blocked when it is shared with a tied lm_head that runs the VNNI kernel
        self._rows = quant_kernel.bound_blocked_rows(weight) if isinstance(weight, BlockedWeight) else None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self._rows is not None:
            return self._rows(ids)
        return self.weight.rows(ids).dequantize(torch.float32)
