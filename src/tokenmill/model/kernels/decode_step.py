"""Wrapper of the fused decode step (csrc/decode_step.cpp), built on first use.

`available()` is False where the extension cannot be built or loaded, or the CPU has no column-blocked
kernel (AVX512-VNNI or AVX2: the step runs only those); the model then runs its layers op by op. A
stack runs the kernels of the kit `kit()` names, the blocked kernel the op-by-op path runs too
(quant_kernel.blocked_kernel, the one switch).
"""

from __future__ import annotations

import logging

import torch

from tokenmill.model.kernels import fused_ops, quant_kernel
from tokenmill.model.kernels.cpp_build import LazyExtension

logger = logging.getLogger(__name__)

_EXTENSION = LazyExtension("decode_step", "CPU fused decode step", logger)


# The C++ kits (csrc/decode_kits.h) by the blocked kernel's name.
KITS = {"vnni": 0, "avx2": 1}


def available() -> bool:
    return quant_kernel.blocked_kernel() in KITS and fused_ops.available() and _EXTENSION.available()


def kit() -> int:
    """The C++ kit of the blocked kernel this process runs (AVX512-VNNI or AVX2)."""
    return KITS[quant_kernel.blocked_kernel()]


def decode_stack(kit_id: int, tensors: list[torch.Tensor], formats: list[int], parts: list[int], k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], final_norm: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, scale: float):
    """The C++ DecodeStack of kit `kit_id` (KITS) over these weights and caches: per layer 2 norms, then for each of its 4
    linears `parts` weights of 4 tensors (codes, scales, mins, subs) and a blocked-format id each, in
    the order model/fused_decode.py lists them."""
    return torch.classes.tokenmill_step.DecodeStack(kit_id, tensors, formats, parts, k_caches, v_caches, final_norm, num_heads,
                                                    num_kv_heads, head_dim, eps, scale)
