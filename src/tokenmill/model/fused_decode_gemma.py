"""The gemma family's decode step as one C++ call (csrc/decode_step_gemma.h), for the fast path.

The same idea as model/fused_decode.py for llama, over gemma's layer (four norms, q/k norms, GeGLU,
two RoPE tables, a window and a score cap per layer). The step takes one block table and one slot
list per layer: `layer_tables` is where a hybrid KV cache hands sliding layers their group's pages;
until then every layer gets the runner's one table.
"""

from __future__ import annotations

import torch

from tokenmill.model.attention import AttentionMetadata, TorchPagedAttention
from tokenmill.model.fused_decode import FusedDecodeStack, _blocked
from tokenmill.model.kernels import decode_step, quant_kernel

LINEARS = ("qkv", "o_proj", "gate_up", "down")


def layer_tables(meta: AttentionMetadata, num_layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(slots, block table) of each layer for this step's decode rows: a layer's own KV group's (the
    hybrid cache hands sliding layers their group's pages, kvcache/ and AttentionMetadata.for_layer)."""
    metas = [meta.for_layer(i) for i in range(num_layers)]
    return [m.slot_mapping for m in metas], [m.decode_block_table for m in metas]


class GemmaFusedDecodeStack:
    """Binds a GemmaForCausalLM's weights and KV caches to a C++ GemmaDecodeStack once."""

    MAX_ROWS = FusedDecodeStack.MAX_ROWS
    max_rows = FusedDecodeStack.max_rows
    handles = FusedDecodeStack.handles

    @staticmethod
    def supports(model) -> bool:
        """Whether the step computes this model: both attentions on the C++ kernel, every linear on a
        blocked kernel (VNNI or AVX2) without bias, and the extension built."""
        for attention in (model.attention, model.sliding_attention):
            if not isinstance(attention, TorchPagedAttention) or not attention.kernel:
                return False
        if not decode_step.available():
            return False
        return all(_blocked(getattr(layer, name)) is not None for layer in model.layers for name in LINEARS)

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        tensors: list[torch.Tensor] = []
        formats: list[int] = []
        parts: list[int] = []
        none = torch.empty(0)
        for layer in model.layers:
            norms = [layer.input_norm, layer.post_attn_norm, layer.pre_mlp_norm, layer.post_mlp_norm,
                     layer.q_norm, layer.k_norm]
            tensors += [none if n is None else n.float().contiguous() for n in norms]
            for name in LINEARS:
                weights = _blocked(getattr(layer, name))
                parts.append(len(weights))
                for w in weights:
                    tensors += [w.codes, w.scales, quant_kernel.or_empty(w.mins), quant_kernel.or_empty(w.subs)]
                    formats.append(w.fmt)
        c = model.config
        windows = [c.sliding_window if layer.sliding else 0 for layer in model.layers]
        ropes = [int(layer.sliding and model.local_rope is not model.rope) for layer in model.layers]
        self.kv_caches = kv_caches
        self.num_layers = len(model.layers)
        self._two_ropes = model.local_rope is not model.rope
        self.kit = decode_step.kit()
        self._stack = torch.classes.tokenmill_step.GemmaDecodeStack(
            self.kit, tensors, formats, parts, [k for k, _ in kv_caches], [v for _, v in kv_caches], model.norm.float().contiguous(),
            windows, ropes, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, model.attention.scale,
            c.attn_logit_softcapping or 0.0)

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], local: tuple[torch.Tensor, torch.Tensor],
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; `x` (the scaled embeddings) is scratch."""
        cos, sin = [rope[0], local[0]], [rope[1], local[1]]
        if not self._two_ropes:
            cos, sin = cos[:1], sin[:1]
        slots, tables = layer_tables(meta, self.num_layers)
        return self._stack.run(x, cos, sin, slots, tables, meta.decode_seq_lens, meta.page_size)
