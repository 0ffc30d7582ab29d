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


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, kv_len: int,
           page_size: int, scale: float, bf16_out: bool = False, unrotate: bool = False,
           out: torch.Tensor | None = None, causal: bool = True, stats: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [Q, H, D] (bfloat16, rows contiguous; H a multiple of the KV heads, D of 16)
    at the last Q of kv_len positions, whose K / V rows lie in the caches [KVH, slots, row] (bf16, or
    int8 rows of a scale and the codes, turned back out of H's basis with `unrotate`) at `pages`,
    page_size slots each: query i sees keys 0 .. kv_len - Q + i (every key where not `causal`, as the
    fused decode step's cascade attends a shared prefix). bf16 products, fp32 scores and softmax,
    weights rounded to bf16 times bf16 values summed in fp32; [Q, H, D] float32, or rounded once to
    bfloat16 with bf16_out, written into `out` where it is given. `stats` (float32 [Q, H, 2]), where
    given, gets each query's softmax max of the scaled scores and its sum of exp(score - max)."""
    return torch.ops.tokenmill_flash.prompt_attention.default(q, k_cache, v_cache, pages, kv_len, page_size, scale,
                                                              bf16_out, unrotate, out, causal, stats)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bf16_out: bool = False) -> torch.Tensor:
    """`attend` over contiguous-row K / V [KVH, T, D] (bf16): the rows as one page of T slots."""
    return attend(q, k, v, torch.zeros(1, dtype=torch.long), k.shape[1], k.shape[1], scale, bf16_out)
