"""Attention over a paged KV cache for one flat batch of mixed decode rows and prefill chunks.

The runner orders the flat batch as: all decode rows first (one query token each), then each prefill
chunk as a contiguous run of tokens. Decode rows are computed together as one padded batched matmul
(the common case at high concurrency); prefill chunks, few per step and long, each go through SDPA.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    q_start: int  # first row of this chunk in the flat batch
    q_len: int
    kv_len: int  # tokens of context including this chunk
    kv_slots: torch.Tensor  # [kv_len] cache slots of positions 0..kv_len-1


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decode: int  # the first num_decode rows are decode rows
    decode_kv_slots: torch.Tensor | None  # [num_decode, max_len] slots, padded
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_len] additive mask: 0 or -inf
    prefills: list[PrefillSpan]


class AttentionBackend(abc.ABC):
    """Computes attention for one layer and writes the new tokens' K/V into the cache.

    Extension point for GPU backends (FlashInfer, Triton); the CPU backend below is the reference.
    """

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        ...


class TorchPagedAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(self, q, k, v, k_cache, v_cache, meta):
        # Write first, so every read below sees the current tokens too.
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        num_tokens = q.shape[0]
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype)
        nd = meta.num_decode
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, span)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _decode(self, q, k_cache, v_cache, meta) -> torch.Tensor:
        nd = q.shape[0]
        # Query heads that share a KV head sit next to each other (HF's repeat_kv order), so grouping
        # them as [nd, kv_heads, group, head_dim] attends GQA without copying K/V per query head.
        qg = q.view(nd, self.num_kv_heads, self.group, self.head_dim)
        keys = k_cache[meta.decode_kv_slots].permute(0, 2, 3, 1)  # [nd, kv_heads, head_dim, L]
        values = v_cache[meta.decode_kv_slots].transpose(1, 2)  # [nd, kv_heads, L, head_dim]
        scores = torch.matmul(qg, keys).mul_(self.scale).add_(meta.decode_mask)
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, values).view(nd, self.num_heads, self.head_dim)

    def _prefill(self, q, k_cache, v_cache, span: PrefillSpan) -> torch.Tensor:
        keys = k_cache[span.kv_slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, L, head_dim]
        values = v_cache[span.kv_slots].transpose(0, 1).unsqueeze(0)
        query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
        if span.kv_len == span.q_len:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
        else:
            # The chunk's queries sit at the end of the context: query i sees keys 0..offset+i.
            offset = span.kv_len - span.q_len
            q_pos = torch.arange(offset, span.kv_len).unsqueeze(1)
            mask = torch.arange(span.kv_len).unsqueeze(0) <= q_pos
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
