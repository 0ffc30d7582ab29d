"""Wrapper of the prompt attention op on AMX tiles (csrc/prompt_flash.cpp), built on first use.

`available()` is False where the CPU (or TOKENMILL_CPU_ISA) gives no AMX-BF16 tiles, the extension
cannot be built, or TOKENMILL_DISABLE_CPU_KERNEL=1: model/prompt_attention.py then runs torch's flash
attention.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.model.kernels.cpp_build import LazyExtension

logger = logging.getLogger(__name__)

_EXTENSION = LazyExtension("prompt_flash", "CPU prompt attention kernel", logger)


def available() -> bool:
    return _EXTENSION.available() and bool(torch.ops.tokenmill_flash.available.default())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bf16_out: bool = False) -> torch.Tensor:
    """Causal attention of q [Q, H, D] at the last Q positions of k, v [KVH, T, D] (all bfloat16, rows
    contiguous; H a multiple of KVH, D of 16): query i sees keys 0 .. T - Q + i. bf16 scores' products,
    fp32 scores and softmax, weights rounded to bf16 times bf16 values summed in fp32; [Q, H, D]
    float32, or rounded once to bfloat16 with bf16_out."""
    return torch.ops.tokenmill_flash.prompt_attention.default(q, k, v, scale, bf16_out)
