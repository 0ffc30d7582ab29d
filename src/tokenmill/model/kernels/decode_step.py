"""Wrapper of the fused decode step (csrc/decode_step.cpp), built on first use.

`available()` is False where the extension cannot be built or loaded, or the CPU lacks AVX512-VNNI
(the step runs the column-blocked kernel only); the model then runs its layers op by op.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.model.kernels import fused_ops, quant_kernel
from tokenmill.model.kernels.cpp_build import LazyExtension

logger = logging.getLogger(__name__)

_EXTENSION = LazyExtension("decode_step", "CPU fused decode step", logger)


def available() -> bool:
    return quant_kernel.vnni_available() and fused_ops.available() and _EXTENSION.available()


def decode_stack(tensors: list[torch.Tensor], formats: list[int], parts: list[int], k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], final_norm: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, scale: float):
    """The C++ DecodeStack over these weights and caches: per layer 2 norms, then for each of its 4
    linears `parts` weights of 4 tensors (codes, scales, mins, subs) and a blocked-format id each, in
    the order model/fused_decode.py lists them."""
    return torch.classes.tokenmill_step.DecodeStack(tensors, formats, parts, k_caches, v_caches, final_norm, num_heads,
                                                    num_kv_heads, head_dim, eps, scale)
