"""Chooses what each linear and embedding runs as, from its weights and the engine's precision.

- exact: everything dense fp32; GGUF matrices of every type dequantized with gguf-py's arithmetic
  (quant_formats), so greedy output is token-identical to transformers on the same file.
- fast: a GGUF matrix of a type the kernels read (`KERNEL_TYPES`) goes to them as the file's own
  blocks, re-laid losslessly (no dequantize-and-quantize-again). A type without a kernel (IQ1/IQ2/
  IQ3, TQ, ...) or a shape the kernel refuses becomes bf16 (an fp32 lm_head: its logits),
  recorded in `LayerPolicy.fallbacks` so the builder can say so in one line. F16 / BF16 matrices
  stay 16-bit; other dense weights run as DenseLinear with a bf16 copy for GEMMs of at least
  `bf16_min_rows` rows, or are quantized at load when `quantization` is int8 / int4 (vLLM's flag,
  for Hugging Face checkpoints). quantization "none" dequantizes a GGUF's matrices (dense fast path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.model import quant
from tokenmill.model.kernels import cpu_isa, quant_kernel
from tokenmill.model.layers.dense_linear import DenseLinear
from tokenmill.model.layers.quantized_linear import NEVER_DENSE, QuantizedEmbedding, QuantizedLinear
from tokenmill.model.quant import BlockedWeight, QuantizedWeight, quantize_int4, quantize_int8
from tokenmill.model.quant_formats import GGUFWeight

Weight = torch.Tensor | GGUFWeight | QuantizedWeight | BlockedWeight
_PACKED = (QuantizedWeight, BlockedWeight)


def kernel_types() -> frozenset[str]:
    """GGUF types the kernels read as they are on this CPU: all of KERNEL_TYPES where a blocked kernel
    runs (AVX512-VNNI or AVX2), else the row-layout kernel's Q4_0 / Q4_1 / Q8_0."""
    if quant_kernel.blocked_kernel():
        return frozenset(quant.KERNEL_TYPES)
    return frozenset(quant.NATIVE_GGUF_TYPES)


@dataclass(frozen=True)
class Fallback:
    """A GGUF matrix fast mode could not give a kernel: what it became and what that costs."""

    kind: str
    file_bytes: int
    resident_bytes: int
    reason: str  # "no kernel" or the kernel's refusal


@dataclass(frozen=True)
class LayerPolicy:
    precision: str = "exact"  # "exact" | "fast"
    quantization: str = "auto"  # one of model/quantization_modes.py's QUANTIZATIONS
    bf16_min_rows: int = 4
    # How blocked GGUF weights run prompt steps: "auto" (per format), "vnni" or "bf16"
    # (layers/quantized_linear.py `prompt_gemm_for`).
    prompt_gemm: str = "auto"
    fallbacks: list[Fallback] = field(default_factory=list, compare=False, repr=False)

    @property
    def keeps_quantized(self) -> bool:
        return self.precision == "fast" and self.quantization != "none"

    def prepare(self, w: Weight, lm_head: bool = False) -> Weight:
        """The weight in the form this policy runs it: a dense tensor or a packed weight."""
        if isinstance(w, BlockedWeight):
            return w
        if isinstance(w, GGUFWeight):
            out = self._prepare_gguf(w, lm_head)
            w.release()  # converted: its file pages may leave this process
            return out
        if isinstance(w, QuantizedWeight):
            return w if self.keeps_quantized else w.dequantize(torch.float32)
        if w.dtype != torch.float32 and (self.precision == "exact" or self.quantization == "none"):
            return w.float()  # 16-bit GGUF matrices: exact values in fp32
        if self.precision == "fast" and self.quantization == "int8":
            return quantize_int8(w.float())
        if self.precision == "fast" and self.quantization == "int4":
            return quantize_int4(w.float())
        return w

    def _prepare_gguf(self, w: GGUFWeight, lm_head: bool) -> Weight:
        if not self.keeps_quantized:
            return w.dequantize(torch.float32)
        reason = "no kernel"
        if w.kind in kernel_types():
            try:
                return _kernel_form(w)
            except ValueError as e:  # a shape the kernel's layout cannot take: the message says why
                reason = str(e)
        # The lm_head stays fp32: its bf16 logits would tie the top tokens (see make_linear).
        dense = w.dequantize(torch.float32 if lm_head else torch.bfloat16)
        self.fallbacks.append(Fallback(w.kind, w.nbytes, dense.nbytes, reason))
        return dense


def _kernel_form(w: GGUFWeight) -> QuantizedWeight | BlockedWeight:
    if quant_kernel.blocked_kernel():  # converted from the mapped bytes, in row chunks
        return quant.to_blocked_gguf(w.kind, w.raw, w.shape)
    return quant.from_gguf_blocks(w.kind, w.raw, w.shape)  # the row-layout kernel


def describe_fallbacks(fallbacks: list[Fallback], ranks: int = 1) -> str | None:
    """One line for the log naming every type that runs dequantized and the memory it costs (with
    `ranks` tensor-parallel ranks, one rank's: each holds its shards of the same matrices)."""
    if not fallbacks:
        return None
    by_kind: dict[str, list[Fallback]] = {}
    for f in fallbacks:
        by_kind.setdefault(f.kind, []).append(f)
    parts = []
    for kind, items in sorted(by_kind.items()):
        reasons = sorted({f.reason for f in items})
        parts.append(f"{kind} ({len(items)} matrices, {'; '.join(reasons)})")
    extra = sum(f.resident_bytes - f.file_bytes for f in fallbacks) / 1e6
    file_mb = sum(f.file_bytes for f in fallbacks) / 1e6
    where = "in the file" if ranks == 1 else f"of this rank's shards (each of the {ranks} tensor-parallel ranks alike)"
    return (f"GGUF matrices without a CPU kernel run dequantized (bf16, an lm_head fp32): {', '.join(parts)}; "
            f"{file_mb:.1f} MB {where} take {file_mb + extra:.1f} MB (+{extra:.1f} MB) and decode slower")


def _stack_gguf(parts: list[Weight]) -> list[Weight]:
    """q/k/v (gate/up) of one GGUF type stacked into one weight (one kernel call); a mix of types
    (Q4_K_M's Q6_K v beside Q4_K q/k) stays apart."""
    same = len(parts) > 1 and all(isinstance(p, GGUFWeight) for p in parts)
    if not same or len({(p.kind, p.shape[1]) for p in parts}) > 1:
        return parts
    stacked = GGUFWeight.cat(parts)
    for p in parts:
        p.release()
    return [stacked]


def make_linear(parts: list[Weight], bias: torch.Tensor | None, policy: LayerPolicy, lm_head: bool = False):
    """One linear over the rows of `parts` stacked (fused q/k/v, gate/up)."""
    prepared = [policy.prepare(p, lm_head) for p in _stack_gguf(parts)]
    if all(isinstance(p, _PACKED) for p in prepared):
        if lm_head:
            # Logits stay fp32 end to end: a bf16 GEMM's output has steps of 0.0625 around a logit of
            # 10, so the top two tokens tie at ~5% of positions (measured: top-1 agreement with the
            # exact path 97.3% with bf16 logits, 99%+ without). The packed kernel accumulates and
            # returns fp32 at every row count, and its AMX tiles take both bf16 terms of the rows even
            # for Q8_0 / Q6_K (one term rounds each logit's inputs once more: the IQ4_XS mix, whose
            # tied lm_head is Q8_0, fell from 99.10 to 98.77 % top-1 on a prompt's logits).
            return QuantizedLinear(prepared[0], bias, dense_min_rows=NEVER_DENSE, two_tile_terms=True)
        if len(prepared) == 1:
            return QuantizedLinear(prepared[0], bias, prompt_gemm=policy.prompt_gemm)
        if all(isinstance(p, QuantizedWeight) for p in prepared):
            try:
                return QuantizedLinear(QuantizedWeight.cat(prepared), bias, prompt_gemm=policy.prompt_gemm)
            except ValueError:  # parts of different formats (a GGUF mixing types): keep them apart
                pass
    if any(isinstance(p, _PACKED) for p in prepared) or len({p.dtype for p in prepared}) > 1:
        return ConcatLinear([_single(p, policy) for p in prepared], bias)
    weight = torch.cat(prepared) if len(prepared) > 1 else prepared[0]
    if policy.precision == "exact":
        return DenseLinear(weight, bias, None)
    # A dense lm_head stays fp32 (bf16 GEMMs round the logits to bf16: ties, see above); quantize it
    # (--quantization int8) for speed.
    return DenseLinear(weight, bias, None if lm_head else _bf16_rows(policy))


def _single(w: Weight, policy: LayerPolicy):
    if isinstance(w, _PACKED):
        return QuantizedLinear(w, None, prompt_gemm=policy.prompt_gemm)
    return DenseLinear(w, None, None if policy.precision == "exact" else _bf16_rows(policy))


def _bf16_rows(policy: LayerPolicy) -> int | None:
    """From how many rows a dense fast-mode linear takes a bf16 GEMM: the policy's count where the CPU
    multiplies bf16 natively, else never (fp32 GEMMs; kernels/cpu_isa.py)."""
    return policy.bf16_min_rows if cpu_isa.bf16_gemm_native() else None


class ConcatLinear:
    """Several linears over the same input, outputs side by side. Where every part runs the blocked
    kernel for the call's rows (a GGUF mix's q/k/v in two formats), one kernel call does them all:
    the input is rounded once and each part writes its columns in place (no concatenation)."""

    def __init__(self, parts: list, bias: torch.Tensor | None) -> None:
        self.parts = parts
        self.bias = bias
        blocked = [p.kernel_weight for p in parts if isinstance(p, QuantizedLinear)]
        self._together = (quant_kernel.bound_blocked_linear_parts(blocked)
                          if len(blocked) == len(parts) and all(w is not None for w in blocked) else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._together is not None and x.dtype == torch.float32 and all(p.runs_kernel(x.shape[0]) for p in self.parts):
            out = self._together(x)
        else:
            out = torch.cat([p(x).float() for p in self.parts], dim=-1)
        return out if self.bias is None else out.add_(self.bias)

    def describe(self) -> str:
        return " + ".join(p.describe() for p in self.parts)


class DenseEmbedding:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # fp32, or 16-bit in fast mode (F16 / BF16 files, types without a kernel)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float()


def make_embedding(weight: Weight, policy: LayerPolicy):
    prepared = policy.prepare(weight)
    if isinstance(prepared, _PACKED):
        return QuantizedEmbedding(prepared)
    return DenseEmbedding(prepared)
