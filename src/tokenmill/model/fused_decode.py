"""The fast path's decode step as one C++ call (csrc/decode_step.cpp explains why).

A step whose rows are all decode rows (one token each, or a speculative run of a few tokens of one
sequence) and few enough for the matrix-vector kernel runs the whole layer stack in one call with one
OpenMP thread team; every other step (prefill chunks, large batches, exact mode, models or weights the
kernel does not cover) runs the layers op by op. Both compute the same arithmetic with the same
kernels, so the outputs agree to float rounding (tests/model/test_fused_decode.py).
"""

from __future__ import annotations

import torch

from tokenmill.model import cpu_attention_kernel
from tokenmill.model.attention import AttentionMetadata, TorchPagedAttention
from tokenmill.model.fused_decode_moe import moe_binding
from tokenmill.model.kernels import decode_step, quant_kernel
from tokenmill.model.layers.factory import ConcatLinear
from tokenmill.model.layers.quantized_linear import (
    AVX2_DENSE_MIN_ROWS,
    BLOCKED_DENSE_MIN_ROWS,
    QuantizedLinear,
)
from tokenmill.model.quant import BlockedWeight


def _blocked(linear) -> list[BlockedWeight] | None:
    """The column-blocked weights a linear runs, in output order (several where a GGUF mixes types
    inside a fused linear, as Q4_K_M does in q/k/v), or None where it does not run a blocked kernel."""
    if isinstance(linear, QuantizedLinear):
        return None if linear.kernel_weight is None else [linear.kernel_weight]
    if isinstance(linear, ConcatLinear) and linear.bias is None:
        parts = [_blocked(p) for p in linear.parts]
        return None if any(p is None for p in parts) else [w for p in parts for w in p]
    return None


class FusedDecodeStack:
    """Binds a model's layer weights and KV caches to a C++ DecodeStack once; `run` is one step."""

    # Rows above this run op by op: the linears switch to bf16 GEMMs from BLOCKED_DENSE_MIN_ROWS (on
    # CPUs with the VNNI kernel; max_rows() is the limit where the AVX2 kernel runs).
    MAX_ROWS = BLOCKED_DENSE_MIN_ROWS - 1

    @classmethod
    def max_rows(cls) -> int:
        """The most rows a fused step takes here: on AVX2 the linears take fp32 GEMMs from AVX2_DENSE_MIN_ROWS."""
        return cls.MAX_ROWS if quant_kernel.blocked_kernel() == "vnni" else AVX2_DENSE_MIN_ROWS - 1

    @staticmethod
    def supports(model) -> bool:
        """Whether every layer is one the fused step computes: llama-style (no q/k norm, no biases),
        all four linears (or every expert's two) on a blocked kernel (VNNI or AVX2), the paged attention
        kernel, and the fused ops built."""
        if not isinstance(model.attention, TorchPagedAttention) or not model.attention.kernel:
            return False
        if model.config.qk_norm or not decode_step.available():
            return False
        # A mixture-of-experts layer (model/moe.py) joins when every expert runs one blocked weight.
        for layer in model.layers:
            routed = hasattr(layer, "moe_block")
            names = ("qkv", "o_proj") if routed else ("qkv", "o_proj", "gate_up", "down")
            if any(_blocked(getattr(layer, name, None)) is None for name in names):
                return False
            if routed and moe_binding(layer) is None:
                return False
        return True

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        tensors: list[torch.Tensor] = []
        formats: list[int] = []
        parts: list[int] = []
        for layer in model.layers:
            tensors += [layer.input_norm.contiguous(), layer.post_norm.contiguous()]
            routed = hasattr(layer, "moe_block")  # its MLP is bound below (no gate_up / down)
            for part in (layer.qkv, layer.o_proj) + (() if routed else (layer.gate_up, layer.down)):
                weights = _blocked(part)
                parts.append(len(weights))
                for w in weights:
                    tensors += [w.codes, w.scales, quant_kernel.or_empty(w.mins), quant_kernel.or_empty(w.subs)]
                    formats.append(w.fmt)
            parts += [0, 0] if routed else []
        c = model.config
        self.kv_caches = kv_caches
        self.kit = decode_step.kit()  # the blocked kernel's (VNNI or AVX2), as the layers op by op run it
        self._stack = decode_step.decode_stack(
            self.kit, tensors, formats, parts, [k for k, _ in kv_caches], [v for _, v in kv_caches], model.norm.contiguous(),
            c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, model.attention.scale)
        for i, layer in enumerate(model.layers):
            moe = moe_binding(layer)
            if moe is not None:
                self._stack.set_moe(i, moe.tensors, moe.formats, moe.router, moe.shared_gate, moe.top_k, moe.norm)
        self.set_cascade(*cpu_attention_kernel.cascade_thresholds(kv_caches[0][0].dtype, fused_step=True))

    def set_cascade(self, min_rows: int, min_prefix: int) -> None:
        """Attend a prefix of >= min_prefix tokens shared by >= min_rows of a step's rows once (min_rows 0: never)."""
        self._stack.set_cascade(min_rows, min_prefix)

    @classmethod
    def handles(cls, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether this step is one the fused call computes. Steps under both kernels' limits skip
        max_rows(): asking which kernel runs is an op call and two environment reads, ~6-15 us of a
        batch-1 token."""
        if meta.num_decode != num_tokens or num_tokens <= 0 or meta.decode_seq_lens is None:
            return False
        return num_tokens < AVX2_DENSE_MIN_ROWS or num_tokens <= cls.max_rows()

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; `x` (the embeddings) is used as scratch."""
        return self._stack.run(x, cos, sin, meta.slot_mapping, meta.decode_block_table, meta.decode_seq_lens,
                               meta.page_size)
