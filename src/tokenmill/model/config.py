"""The architecture hyper-parameters of a decoder-only transformer, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.model.moe_config import MoEConfig


@dataclass(frozen=True)
class ModelConfig:
    # Registry key: the Hugging Face `model_type` ("llama", "mistral", "qwen2", "qwen3").
    # GGUF `general.architecture` values are mapped onto these by the loader.
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # The HF `rope_scaling` dict as given (e.g. llama3: factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None means plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (model/moe.py); None: every layer has a dense MLP.
    moe: MoEConfig | None = None
    # Sliding-window attention (gemma2 / gemma3): one entry per layer, "sliding_attention" or
    # "full_attention"; None means every layer attends to the whole context. A sliding layer's query
    # at position p sees keys p - sliding_window + 1 .. p (transformers' and llama.cpp's rule).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    # RoPE theta of the sliding layers when it differs from the global one (gemma3: 10,000 vs 1e6;
    # the global layers' rope_scaling does not apply to them).
    rope_local_theta: float | None = None
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 when set (gemma), else head_dim's.
    query_pre_attn_scalar: float | None = None
    # gemma2: tanh soft-capping cap * tanh(x / cap) of attention scores and of the final logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"
