"""The gemma family of decoders: Gemma 2 and Gemma 3 (text).

What sets them apart from the llama family (model/llama.py, whose norm, linears, embeddings and
RoPE this module reuses):
- embeddings scaled by sqrt(hidden) (in the activation dtype, as transformers does);
- four RMSNorms per layer: before and after attention, before and after the MLP;
- GeGLU (tanh-approximated GELU) instead of SiLU;
- attention scaled by query_pre_attn_scalar ** -0.5; Gemma 3 normalises each q/k head before RoPE;
- sliding-window layers beside full ones (the pattern comes from the config); Gemma 3's sliding
  layers use their own RoPE theta (10,000) and no RoPE scaling;
- Gemma 2 soft-caps attention scores and the final logits (cap * tanh(x / cap)).

Norm weights are held as the multiplier they act as: Hugging Face files store w for x * (1 + w)
and the loader adds the 1 (model/gemma_files.py); llama.cpp's converter already stored 1 + w.

Fast mode runs steps of decode rows (and whole prompts, sent as decode rows) as one C++ call over the
layer stack (model/fused_decode_gemma.py) where the weights run the VNNI kernel; other steps run op
by op (quantized linears, bf16 KV, the C++ paged-attention kernel, which takes the window and the
soft-cap, for decode rows).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from tokenmill.model.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from tokenmill.model.config import ModelConfig
from tokenmill.model.fused_decode_gemma import GemmaFusedDecodeStack
from tokenmill.model.layers.factory import LayerPolicy, make_embedding, make_linear
from tokenmill.model.layers.quantized_linear import QuantizedLinear
from tokenmill.model.llama import fused_rms_norm, rms_norm, weight_bytes
from tokenmill.model.rope import RotaryEmbedding
from tokenmill.model.window_attention import WindowedPagedAttention

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaDecoderLayer:
    def __init__(self, config: ModelConfig, weights: dict, prefix: str, policy: LayerPolicy, sliding: bool):
        def w(name: str):
            return weights[prefix + name]

        c = config
        self.sliding = sliding
        self.eps = c.rms_norm_eps
        self.norm = rms_norm if policy.precision == "exact" else fused_rms_norm
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        qkv = [w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]
        self.qkv = make_linear(qkv, None, policy)
        self.o_proj = make_linear([w("self_attn.o_proj.weight")], None, policy)
        self.gate_up = make_linear([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")], None, policy)
        self.down = make_linear([w("mlp.down_proj.weight")], None, policy)
        self.input_norm, self.post_attn_norm, self.pre_mlp_norm, self.post_mlp_norm = (
            w(f"{name}.weight") for name in NORMS)
        self.q_norm = w("self_attn.q_norm.weight") if c.qk_norm else None
        self.k_norm = w("self_attn.k_norm.weight") if c.qk_norm else None
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

    def forward(self, x, cos, sin, attention: AttentionBackend, k_cache, v_cache, meta) -> torch.Tensor:
        t, norm, eps = x.shape[0], self.norm, self.eps
        qkv = self.qkv(norm(x, self.input_norm, eps))
        q = qkv[:, : self.q_size].reshape(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = norm(q, self.q_norm, eps), norm(k, self.k_norm, eps)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        attn = attention.forward(q.contiguous(), k, v, k_cache, v_cache, meta)
        x = x + norm(self.o_proj(attn), self.post_attn_norm, eps)
        gate, up = self.gate_up(norm(x, self.pre_mlp_norm, eps)).chunk(2, dim=-1)
        mlp = self.down(F.gelu(gate, approximate="tanh") * up)
        return x + norm(mlp, self.post_mlp_norm, eps)

    def parts(self) -> tuple:
        return (self.qkv, self.o_proj, self.gate_up, self.down, self.input_norm, self.post_attn_norm,
                self.pre_mlp_norm, self.post_mlp_norm, self.q_norm, self.k_norm)


def _vnni_at_any_rows(linear) -> bool:
    """Whether `linear` (or every part of a concatenated one) runs the VNNI kernel at any row count,
    rather than a bf16 GEMM from some count on (the engine setting prompt_gemm, per format under "auto")."""
    parts = getattr(linear, "parts", None)
    if parts is not None:
        return all(_vnni_at_any_rows(p) for p in parts)
    return isinstance(linear, QuantizedLinear) and linear.kernel_at_any_rows


def _attention_for(config: ModelConfig, window: int | None) -> TorchPagedAttention:
    c = config
    scale = None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5
    if window is None and c.attn_logit_softcapping is None:
        return TorchPagedAttention(c.num_heads, c.num_kv_heads, c.head_dim, scale)  # the C++ kernel decodes
    return WindowedPagedAttention(c.num_heads, c.num_kv_heads, c.head_dim, scale, window, c.attn_logit_softcapping)


class GemmaForCausalLM:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict,
        max_positions: int,
        policy: LayerPolicy | None = None,
        attention: AttentionBackend | None = None,
    ) -> None:
        self.config = c = config
        policy = policy or LayerPolicy()
        embed = policy.prepare(weights["model.embed_tokens.weight"])
        self.layers = [GemmaDecoderLayer(c, weights, f"model.layers.{i}.", policy, c.is_sliding(i))
                       for i in range(c.num_layers)]
        self.norm = weights["model.norm.weight"]
        lm_head = embed if c.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = make_linear([lm_head], None, policy, lm_head=True)
        if c.tie_word_embeddings and isinstance(self.lm_head, QuantizedLinear):
            embed = self.lm_head.weight  # one copy, in the lm_head's layout
        self.embed_tokens = make_embedding(embed, policy)
        # A Python float, rounded to the activations' dtype when applied (transformers' buffer).
        self.embed_scale = c.hidden_size**0.5
        self.rope = RotaryEmbedding(c, max_positions)
        local = dataclasses.replace(c, rope_theta=c.rope_local_theta, rope_scaling=None)
        self.local_rope = RotaryEmbedding(local, max_positions) if c.rope_local_theta is not None else self.rope
        self.attention = attention or _attention_for(c, None)
        self.sliding_attention = _attention_for(c, c.sliding_window) if c.layer_types else self.attention
        # The runner attends whole prompts as decode rows only through the C++ kernel (fast mode).
        self.prompts_as_decode_rows = self.attention.kernel and self.sliding_attention.kernel
        self.fused_decode = policy.precision == "fast" and GemmaFusedDecodeStack.supports(self)
        # Prompts too where every linear runs many rows on the VNNI kernel (not the bf16 GEMM).
        self.prompts_in_stack = self.fused_decode and all(
            _vnni_at_any_rows(part) for layer in self.layers for part in layer.parts()[:4])
        self._decode_stack: GemmaFusedDecodeStack | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = self.rope.lookup(positions)
        local = self.local_rope.lookup(positions) if self.local_rope is not self.rope else rope
        if self.fused_decode and self._fused_step(x.shape[0], meta):
            return self._stack_for(kv_caches).run(x, rope, local, meta)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            cos, sin = local if layer.sliding else rope
            attention = self.sliding_attention if layer.sliding else self.attention
            x = layer.forward(x, cos, sin, attention, k_cache, v_cache, meta.for_layer(i))
        return self.layers[0].norm(x, self.norm, self.config.rms_norm_eps)

    def _fused_step(self, rows: int, meta: AttentionMetadata) -> bool:
        """Whether the fused stack computes this step: decode rows, and in fast mode whole prompts,
        which the runner sends as decode rows. The stack's linears are the VNNI kernel the op-by-op
        path runs at every row count too (prompt_gemm "vnni", or "auto" where every format says so); it fuses the rest of each layer
        (norms, RoPE, cache writes, GeGLU; float rounding apart, the same arithmetic) into one
        parallel region instead of ~25 PyTorch ops a layer."""
        if self.prompts_in_stack:
            return meta.num_decode == rows and rows > 0 and meta.decode_seq_lens is not None
        return GemmaFusedDecodeStack.handles(rows, meta)

    def _stack_for(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> GemmaFusedDecodeStack:
        if self._decode_stack is None or self._decode_stack.kv_caches is not kv_caches:
            self._decode_stack = GemmaFusedDecodeStack(self, kv_caches)
        return self._decode_stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the rows that sample, soft-capped where the model says so (gemma2)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def weight_bytes(self) -> int:
        """Bytes of weights the model holds (shared tensors, e.g. tied embeddings, counted once)."""
        return weight_bytes([self.embed_tokens, self.lm_head, self.norm]
                            + [part for layer in self.layers for part in layer.parts()])

    def describe(self) -> list[str]:
        """What each kind of layer runs as (logged at start-up)."""
        first = self.layers[0]
        parts = {"qkv": first.qkv, "o_proj": first.o_proj, "gate_up": first.gate_up, "down": first.down,
                 "lm_head": self.lm_head}
        lines = [f"{name}: {layer.describe()}" for name, layer in parts.items()]
        sliding = sum(layer.sliding for layer in self.layers)
        if sliding:
            lines.append(f"{sliding} of {len(self.layers)} layers attend a sliding window of "
                         f"{self.config.sliding_window} tokens")
        if self.fused_decode:
            rows = "any number, prompts too" if self.prompts_in_stack else f"up to {GemmaFusedDecodeStack.max_rows()}"
            lines.append(f"steps of all decode rows ({rows}): one fused C++ call over the layer stack")
        return lines
