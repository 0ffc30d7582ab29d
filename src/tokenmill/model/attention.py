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

from tokenmill.model import cpu_attention_kernel, prompt_attention
from tokenmill.model.kv_cache_format import KVCacheFormat


@dataclass
class PrefillSpan:
    q_start: int  # first row of this chunk in the flat batch
    q_len: int
    kv_len: int  # tokens of context including this chunk
    pages: torch.Tensor  # [ceil(kv_len / page_size)] the sequence's pages, in position order


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decode: int  # the first num_decode rows are decode rows
    page_size: int
    decode_block_table: torch.Tensor | None  # [num_decode, max_pages] page ids, padded with page 0
    # [1, num_decode, 1, max_pages * page_size] additive: 0 or -inf; None: built from decode_seq_lens
    # when the PyTorch path needs it (the C++ kernel never does)
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSpan]
    decode_seq_lens: torch.Tensor | None = None  # [num_decode] int64 context lengths (for the C++ kernel)
    # Hybrid KV cache (kvcache/kv_groups.py): the metadata of each layer's KV group, by layer index
    # (sliding groups have their own block tables and slots); None: every layer uses this one.
    layer_metas: list[AttentionMetadata] | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` attends with (its KV group's block tables and slots)."""
        return self if self.layer_metas is None else self.layer_metas[layer]


def decode_mask(lengths: torch.Tensor, padded_len: int) -> torch.Tensor:
    """[1, rows, 1, padded_len] additive mask: 0 for each row's first `length` positions, -inf after."""
    valid = torch.arange(padded_len).unsqueeze(0) < lengths.unsqueeze(1)
    return torch.zeros(valid.shape).masked_fill_(~valid, float("-inf")).view(1, len(lengths), 1, -1)


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
        k_cache: torch.Tensor,  # [num_kv_heads, num_pages * page_size, row] (model/kv_cache_format.py)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        ...

    @abc.abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`forward` for tokens whose K/V a fused op has already written into the cache; the output in
        `out_dtype` (default q's), rounded as `.to(out_dtype)` would round it."""

    def bf16_queries(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> bool:
        """Whether `attend` takes this step's queries in bf16 (and gives its output in bf16)."""
        return False


class TorchPagedAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 bf16_prompts: bool = False) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        # SDPA gets a scale only when the model sets one (gemma's query_pre_attn_scalar): its own
        # default is what transformers' llama-family models use, to the last bit.
        self.sdpa_scale = scale
        # Build/load the C++ decode kernel now, not in the first step; decided once (an environment
        # lookup per layer and step cost ~0.25 ms of a 6 ms batch-1 step).
        self.kernel = cpu_attention_kernel.available()
        # Prefill chunks over bf16 / int8 caches in bf16 on AMX tiles (prompt_attention.py):
        # fast mode on CPUs with AMX; otherwise they are computed in fp32 from the decoded rows.
        self.bf16_prompts = bf16_prompts

    def forward(self, q, k, v, k_cache, v_cache, meta):
        # Write first, so every read below sees the current tokens too.
        fmt = KVCacheFormat.of(k_cache)
        fmt.write(k_cache, meta.slot_mapping, k)
        fmt.write(v_cache, meta.slot_mapping, v)
        return self.attend(q, k_cache, v_cache, meta)

    def bf16_queries(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> bool:
        """Whether this step's queries may come in bf16 (and its output leave in bf16): every row is
        a prompt chunk's that the tiles attend in bf16 (prompt_attention.py) with its
        queries as they are (not rotated into int8 rows' basis), so they would be rounded to bf16 on
        the way in anyway and the output comes back in bf16."""
        if not (self.bf16_prompts and meta.num_decode == 0 and meta.prefills):
            return False
        fmt = KVCacheFormat.of(k_cache)
        return fmt.name != "fp32" and not any(
            prompt_attention.rotates_queries(fmt, self.head_dim, span.q_len * self.num_heads,
                                             span.kv_len * self.num_kv_heads) for span in meta.prefills)

    def attend(self, q, k_cache, v_cache, meta, out_dtype=None):
        num_tokens = q.shape[0]
        nd = meta.num_decode
        out_dtype = out_dtype or q.dtype
        if nd == num_tokens:  # decode rows only (the common step): no output buffer to fill
            out = self._decode(q, k_cache, v_cache, meta).view(num_tokens, self.num_heads * self.head_dim)
            return out.to(out_dtype)
        if nd == 0 and len(meta.prefills) == 1 and meta.prefills[0].q_len == num_tokens:
            # one prompt chunk: its attention is the output (contiguous from the flash kernel)
            return self._prefill(q, k_cache, v_cache, meta.prefills[0], meta.page_size, out_dtype).reshape(num_tokens, -1)
        # A step of decode rows and prompt chunks (serving's usual prompt step): each part is written
        # into the output in out_dtype (bf16 where o_proj runs a bf16 GEMM: no float32 round trip)
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=out_dtype)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for span in meta.prefills:
            rows = out[span.q_start:span.q_start + span.q_len]
            part = self._prefill(q[span.q_start:span.q_start + span.q_len], k_cache, v_cache, span, meta.page_size,
                                 out_dtype, into=rows)
            if part is not rows:  # not written in place
                rows.copy_(part)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _gather_pages(self, cache: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
        """[kv_heads, len(pages) * page_size, head_dim]: the pages' K or V, in order, in fp32.

        Whole pages are copied (rows of page_size * head_dim floats), one index_select along dim 0
        per KV head into a preallocated output: measured ~7x faster than one index_select along
        dim 1, and than gathering single token slots.
        """
        # bf16 and int8 caches are computed with in fp32, like the decode kernel does.
        return KVCacheFormat.of(cache).decode(self._gather_rows(cache, pages, page_size))

    @staticmethod
    def _gather_rows(cache: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
        """[kv_heads, len(pages) * page_size, row]: the pages' stored rows, in order."""
        kvh, num_slots, row = cache.shape
        by_page = cache.view(kvh, num_slots // page_size, page_size * row)
        out = torch.empty(kvh, pages.shape[0], page_size * row, dtype=cache.dtype)
        for head in range(kvh):
            torch.index_select(by_page[head], 0, pages, out=out[head])
        return out.view(kvh, -1, row)

    def _decode(self, q, k_cache, v_cache, meta) -> torch.Tensor:
        # The fused C++ kernel reads K/V through the block table: no gather, no padding.
        if meta.decode_seq_lens is not None and self.kernel:
            return cpu_attention_kernel.paged_decode_attention(
                q, k_cache, v_cache, meta.decode_block_table, meta.decode_seq_lens, meta.page_size, self.scale
            )
        table = meta.decode_block_table
        nd, max_pages = table.shape
        kvh, group, hd = self.num_kv_heads, self.group, self.head_dim
        # The cache is head-major, so the gather yields [kv_heads, nd, L, head_dim]: contiguous
        # matrices per (head, sequence) that matmul reads directly (K transposed via strides).
        keys = self._gather_pages(k_cache, table.view(-1), meta.page_size).view(kvh, nd, -1, hd)
        values = self._gather_pages(v_cache, table.view(-1), meta.page_size).view(kvh, nd, -1, hd)
        # Query heads that share a KV head sit next to each other (HF's repeat_kv order), so grouping
        # them as [kv_heads, nd, group, head_dim] attends GQA without copying K/V per query head.
        qg = q.view(nd, kvh, group, hd).transpose(0, 1)
        mask = meta.decode_mask if meta.decode_mask is not None else decode_mask(meta.decode_seq_lens, max_pages * meta.page_size)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(self.scale).add_(mask)
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values)  # [kv_heads, nd, group, head_dim]
        return out.transpose(0, 1).reshape(nd, self.num_heads, hd)

    def _prefill(self, q, k_cache, v_cache, span: PrefillSpan, page_size: int,
                 out_dtype: torch.dtype | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """The chunk's attention [q_len, heads, head_dim]: `into` itself where the path writes it there."""
        fmt = KVCacheFormat.of(k_cache)
        if self.bf16_prompts and fmt.name != "fp32" and prompt_attention.on_tiles_for(self.head_dim):
            return prompt_attention.attend_pages(q, k_cache, v_cache, span.pages, span.kv_len, page_size, fmt,
                                                 self.sdpa_scale, out_dtype, into)
        if self.bf16_prompts and fmt.name != "fp32":
            keys = self._gather_rows(k_cache, span.pages, page_size)[:, : span.kv_len]
            values = self._gather_rows(v_cache, span.pages, page_size)[:, : span.kv_len]
            return prompt_attention.attend(q, keys, values, fmt, self.sdpa_scale, out_dtype)
        keys = self._gather_pages(k_cache, span.pages, page_size)[:, : span.kv_len].unsqueeze(0)
        values = self._gather_pages(v_cache, span.pages, page_size)[:, : span.kv_len].unsqueeze(0)
        query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
        if span.kv_len == span.q_len:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True,
                                                 scale=self.sdpa_scale)
        else:
            # The chunk's queries sit at the end of the context: query i sees keys 0..offset+i.
            offset = span.kv_len - span.q_len
            q_pos = torch.arange(offset, span.kv_len).unsqueeze(1)
            mask = torch.arange(span.kv_len).unsqueeze(0) <= q_pos
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True,
                                                 scale=self.sdpa_scale)
        return out.squeeze(0).transpose(0, 1).to(out_dtype or q.dtype)
