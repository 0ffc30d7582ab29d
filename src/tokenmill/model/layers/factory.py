"""Chooses what each linear and embedding runs as, from its weights and the engine's precision.

- exact: everything dense fp32 (quantized GGUF matrices dequantized with gguf's arithmetic), so
  greedy output is token-identical to transformers.
- fast: quantized weights stay quantized (QuantizedLinear); dense weights run as DenseLinear with a
  bf16 copy for GEMMs of at least `bf16_min_rows` rows, or are quantized at load when `quantization`
  is int8 / int4 (vLLM's flag, for Hugging Face checkpoints). quantization "none" dequantizes a GGUF's
  quantized matrices as well (the dense fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.model.layers.dense_linear import DenseLinear
from tokenmill.model.layers.quantized_linear import NEVER_DENSE, QuantizedEmbedding, QuantizedLinear
from tokenmill.model.quant import BlockedWeight, QuantizedWeight, quantize_int4, quantize_int8

Weight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True)
class LayerPolicy:
    precision: str = "exact"  # "exact" | "fast"
    quantization: str = "auto"  # one of model/quantization_modes.py's QUANTIZATIONS
    bf16_min_rows: int = 4

    @property
    def keeps_quantized(self) -> bool:
        return self.precision == "fast" and self.quantization != "none"

    def prepare(self, w: Weight) -> Weight:
        """The weight in the form this policy runs it: fp32 tensor or QuantizedWeight."""
        if isinstance(w, QuantizedWeight):
            return w if self.keeps_quantized else w.dequantize(torch.float32)
        if self.precision == "fast" and self.quantization == "int8":
            return quantize_int8(w)
        if self.precision == "fast" and self.quantization == "int4":
            return quantize_int4(w)
        return w


# GGUF types dequantized at load (no native kernel) and what fast mode re-quantizes them to: 4-bit
# and smaller ones to int4 (0.625 bytes a weight, within 1.3x of Q4_K's 0.5625), the rest to int8.
_INT4_SOURCES = ("Q2_K", "Q3_K", "Q4_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS")
_UNQUANTIZED = ("F32", "F16", "BF16", "F64")


def requantize_for_fast_path(weights: dict, gguf_types: dict[str, str], policy: LayerPolicy) -> dict:
    """A copy of `weights` in which matrices of a quantized GGUF type that was dequantized at load
    (K-quants, Q5_x, ...) are quantized again into the packed format, so fast mode keeps a K-quant
    file near its size too. The exact path keeps the fp32 values."""
    if not policy.keeps_quantized or not gguf_types:
        return weights
    out = dict(weights)
    for name, kind in gguf_types.items():
        w = weights[name]
        if kind in _UNQUANTIZED or isinstance(w, QuantizedWeight) or w.dim() != 2 or w.shape[1] % 32:
            continue
        qw = quantize_int4(w) if kind in _INT4_SOURCES else quantize_int8(w)
        out[name] = QuantizedWeight(qw.codes, qw.scales, qw.mins, qw.bits, f"{kind}->{qw.kind}")
    return out


def make_linear(parts: list[Weight], bias: torch.Tensor | None, policy: LayerPolicy, lm_head: bool = False):
    """One linear over the rows of `parts` stacked (fused q/k/v, gate/up)."""
    prepared = [policy.prepare(p) for p in parts]
    if all(isinstance(p, QuantizedWeight) for p in prepared):
        if lm_head:
            # Logits stay fp32 end to end: a bf16 GEMM's output has steps of 0.0625 around a logit of
            # 10, so the top two tokens tie at ~5% of positions (measured: top-1 agreement with the
            # exact path 97.3% with bf16 logits, 99%+ without). The packed kernel accumulates and
            # returns fp32 at every row count.
            return QuantizedLinear(prepared[0], bias, dense_min_rows=NEVER_DENSE)
        try:
            return QuantizedLinear(QuantizedWeight.cat(prepared) if len(prepared) > 1 else prepared[0], bias)
        except ValueError:  # parts of different formats (a GGUF mixing types): keep them apart
            return ConcatLinear([QuantizedLinear(p, None) for p in prepared], bias)
    dense = [p.dequantize(torch.float32) if isinstance(p, QuantizedWeight) else p for p in prepared]
    weight = torch.cat(dense) if len(dense) > 1 else dense[0]
    if policy.precision == "exact":
        return DenseLinear(weight, bias, None)
    # A dense lm_head stays fp32 (bf16 GEMMs round the logits to bf16: ties, see above); quantize it
    # (--quantization int8) for speed.
    return DenseLinear(weight, bias, None if lm_head else policy.bf16_min_rows)


class ConcatLinear:
    """Several linears over the same input, outputs side by side."""

    def __init__(self, parts: list[QuantizedLinear], bias: torch.Tensor | None) -> None:
        self.parts = parts
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p(x) for p in self.parts], dim=-1)
        return out if self.bias is None else out.add_(self.bias)

    def describe(self) -> str:
        return " + ".join(p.describe() for p in self.parts)


class DenseEmbedding:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def make_embedding(weight: Weight | BlockedWeight, policy: LayerPolicy):
    prepared = weight if isinstance(weight, BlockedWeight) else policy.prepare(weight)
    if isinstance(prepared, (QuantizedWeight, BlockedWeight)):
        return QuantizedEmbedding(prepared)
    return DenseEmbedding(prepared)
