"""What the fused decode step needs of a mixture-of-experts layer (csrc/decode_step_moe.h): each
expert's gate_up and down as ONE column-blocked weight, the fp32 router, the shared expert and its
gate. Its own module so model/fused_decode.py stays about dense layers; it reads a layer by its
attributes (`moe_block`, `combine`), never importing model/moe.py (which imports the llama family,
which imports the fused step).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenmill.model.kernels import quant_kernel
from tokenmill.model.layers.quantized_linear import QuantizedLinear


class MoEBinding(NamedTuple):
    tensors: list[torch.Tensor]  # per expert gate_up then down: codes, scales, mins, subs
    formats: list[int]
    router: torch.Tensor  # fp32 [experts, hidden]
    shared_gate: torch.Tensor  # fp32 [hidden]; empty without a shared expert
    top_k: int
    norm: bool


def _single(linear) -> list:
    """The 4 tensors and the format of a linear that runs one blocked weight, else []."""
    if not isinstance(linear, QuantizedLinear) or linear.kernel_weight is None:
        return []
    w = linear.kernel_weight
    return [w.codes, w.scales, quant_kernel.or_empty(w.mins), quant_kernel.or_empty(w.subs), w.fmt]


def moe_binding(layer) -> MoEBinding | None:
    """The layer's routed block as the fused step takes it; None where the step cannot run it (a layer
    without experts, tensor-parallel partial sums, an expert whose gate and up differ in type)."""
    block = getattr(layer, "moe_block", None)
    if block is None or getattr(layer, "combine", None) is not None:
        return None
    experts = list(block.experts) + ([block.shared] if block.shared is not None else [])
    tensors: list[torch.Tensor] = []
    formats: list[int] = []
    for expert in experts:
        for linear in (expert.gate_up, expert.down):
            parts = _single(linear)
            if not parts:
                return None
            tensors += parts[:4]
            formats.append(parts[4])
    gate = block.shared_gate.reshape(-1).contiguous() if block.shared is not None else torch.empty(0)
    return MoEBinding(tensors, formats, block.router, gate, block.moe.top_k, block.moe.norm_topk_prob)
