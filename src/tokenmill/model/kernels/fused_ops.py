"""Wrapper of the fused elementwise ops of the fast path (csrc/fused_ops.cpp), built on first use.

`available()` is False where the extension cannot be built (or TOKENMILL_DISABLE_CPU_KERNEL=1): the
model then runs the same steps as separate PyTorch ops.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.model.kernels.cpp_build import LazyExtension

logger = logging.getLogger(__name__)

_EXTENSION = LazyExtension("fused_ops", "CPU fused-ops kernel", logger)


def available() -> bool:
    return _EXTENSION.available()


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int):
    """(q [T, nq, D], k [T, nkv, D]) with RoPE applied, from the fused q/k/v projection output."""
    return torch.ops.tokenmill_fused.rope_qk.default(qkv, cos, sin, nq, nkv)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, q_bf16: bool = False) -> torch.Tensor:
    """q [T, nq, D] with RoPE applied (float32, or with `q_bf16` the same values rounded to bfloat16);
    k (with RoPE) and v written to the caches at `slots`."""
    return torch.ops.tokenmill_fused.rope_store.default(qkv, cos, sin, nq, nkv, k_cache, v_cache, slots, q_bf16)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up], in gate_up's dtype (float32 or bfloat16)."""
    return torch.ops.tokenmill_fused.silu_mul.default(gate_up)


def weighted_index_add_(out: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> None:
    """out[rows[i]] += y[i] * weights[i] in place (float32; rows distinct): the same numbers as
    `out.index_add_(0, rows, y * weights)`, in one pass."""
    torch.ops.tokenmill_fused.weighted_index_add_.default(out, rows, y, weights)


def merge_attention(own: torch.Tensor, prefix: torch.Tensor, share: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
    """own + (prefix - own) * share[..., None] for attention outputs [1, H, L, D] (float32 or bfloat16)
    and share [1, H, L]: the numbers of that expression on float32 tensors, in one pass; float32, or
    rounded once to bfloat16 with bf16_out."""
    return torch.ops.tokenmill_fused.merge_attention.default(own, prefix, share, bf16_out)


def int8_rows_values(rows: torch.Tensor, unrotate: bool = False) -> torch.Tensor:
    """int8 cache rows [..., 4 + head_dim] as bfloat16 values [..., head_dim]: code x scale, the numbers
    of `KVCacheFormat.stored_values(rows, torch.bfloat16)` in one pass; with `unrotate`, the rows' H x
    rotated back to x before the rounding (kv_cache_format.py)."""
    return torch.ops.tokenmill_fused.int8_rows_values.default(rows, unrotate)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                  bf16_out: bool = False) -> torch.Tensor:
    """x += delta (float32 or bfloat16) in place; returns RMSNorm(x) * weight (bfloat16 if bf16_out)."""
    return torch.ops.tokenmill_fused.add_rms_norm_.default(x, delta, weight, eps, bf16_out)
