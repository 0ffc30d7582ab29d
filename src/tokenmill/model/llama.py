"""The llama family of decoders: llama (incl. llama3 RoPE scaling, tied embeddings), mistral,
qwen2 (q/k/v bias) and qwen3 (RMSNorm on each q/k head). They differ only in flags of ModelConfig.

The model works on one flat batch of tokens from many requests: `forward(input_ids, positions, meta)`
with no batch dimension; which request a token belongs to only matters to attention, via `meta`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from tokenmill.model.config import ModelConfig
from tokenmill.model.linear import Linear
from tokenmill.model.rope import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operation order as transformers' LlamaRMSNorm, so fp32 results agree to the last bits.
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One kernel instead of five passes over x; rounding differs from transformers' in the last
    # bits, so only fast mode uses it.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class DecoderLayer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, bf16_min_rows: int | None):
        def w(name: str) -> torch.Tensor:
            return weights[prefix + name]

        c = config
        self.eps = c.rms_norm_eps
        self.norm = rms_norm if bf16_min_rows is None else fused_rms_norm
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        # q, k and v (and gate and up) share their input: one fused GEMM each instead of three/two.
        qkv = torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")])
        qkv_bias = None
        if c.attention_bias:
            qkv_bias = torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"), w("self_attn.v_proj.bias")])
        self.qkv = Linear(qkv, qkv_bias, bf16_min_rows)
        self.o_proj = Linear(w("self_attn.o_proj.weight"), None, bf16_min_rows)
        self.gate_up = Linear(torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]), None, bf16_min_rows)
        self.down = Linear(w("mlp.down_proj.weight"), None, bf16_min_rows)
        self.input_norm = w("input_layernorm.weight")
        self.post_norm = w("post_attention_layernorm.weight")
        self.q_norm = w("self_attn.q_norm.weight") if c.qk_norm else None
        self.k_norm = w("self_attn.k_norm.weight") if c.qk_norm else None
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

    def forward(self, x, cos, sin, attention, k_cache, v_cache, meta):
        t = x.shape[0]
        norm = self.norm
        h = norm(x, self.input_norm, self.eps)
        qkv = self.qkv(h)
        v = qkv[:, self.q_size + self.kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k heads side by side: RoPE in one pass over both (same arithmetic per element).
            qk = qkv[:, : self.q_size + self.kv_size].reshape(t, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = RotaryEmbedding.apply(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = norm(qkv[:, : self.q_size].reshape(t, self.num_heads, self.head_dim), self.q_norm, self.eps)
            k = norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(t, self.num_kv_heads, self.head_dim),
                     self.k_norm, self.eps)
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        attn = attention.forward(q.contiguous(), k, v, k_cache, v_cache, meta)
        x = x + self.o_proj(attn)
        h = norm(x, self.post_norm, self.eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaForCausalLM:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        bf16_min_rows: int | None = None,
        attention: AttentionBackend | None = None,
    ) -> None:
        self.config = config
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.layers = [
            DecoderLayer(config, weights, f"model.layers.{i}.", bf16_min_rows) for i in range(config.num_layers)
        ]
        self.norm = weights["model.norm.weight"]
        lm_head = self.embed_tokens if config.tie_word_embeddings else weights["lm_head.weight"]
        # The lm_head is the one big matrix-vector product: bf16 halves the bytes read and measured
        # 3x faster than fp32 even for a single row, so fast mode always uses it.
        self.lm_head = Linear(lm_head, None, None if bf16_min_rows is None else 1)
        self.rope = RotaryEmbedding(config, max_positions)
        self.attention = attention or TorchPagedAttention(config.num_heads, config.num_kv_heads, config.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rope.lookup(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer.forward(x, cos, sin, self.attention, k_cache, v_cache, meta)
        return self.layers[0].norm(x, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the rows that sample; the sampler always sees fp32."""
        return self.lm_head(hidden).float()
