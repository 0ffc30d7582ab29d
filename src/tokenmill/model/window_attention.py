"""Paged attention with a sliding window and/or tanh soft-capped scores (gemma's layers).

A sliding layer's query at position p sees keys p - window + 1 .. p (transformers'
`sliding_window_overlay`, llama.cpp's LLAMA_SWA_TYPE_STANDARD). Gemma 2 also caps every score as
cap * tanh(score / cap) before the mask. Decode rows (and fast mode's prompts sent as decode rows)
go through the C++ kernel, which takes both (csrc/paged_attention_common.h); without it, and for
prefill chunks, these layers run the PyTorch paths of attention.py with a banded mask. Either way
only the pages the window covers are read: a sliding layer's decode row reads at most
window + page_size keys, however long its context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model import cpu_attention_kernel
from tokenmill.model.attention import PrefillSpan, TorchPagedAttention


class WindowedPagedAttention(TorchPagedAttention):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None,
                 window: int | None, softcap: float | None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.window = window
        self.softcap = softcap

    def _first_visible(self, last_pos: torch.Tensor) -> torch.Tensor:
        """First key position a query at `last_pos` sees (0 without a window)."""
        if self.window is None:
            return torch.zeros_like(last_pos)
        return (last_pos - self.window + 1).clamp_(min=0)

    def _scores(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Softmax weights; same operation order as transformers' eager attention (scale, cap, mask)."""
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)

    def _decode(self, q, k_cache, v_cache, meta) -> torch.Tensor:
        table, lengths, size = meta.decode_block_table, meta.decode_seq_lens, meta.page_size
        if self.kernel and lengths is not None:
            return cpu_attention_kernel.paged_decode_attention(
                q, k_cache, v_cache, table, lengths, size, self.scale, window=self.window, softcap=self.softcap)
        nd, max_pages = table.shape
        lo = self._first_visible(lengths - 1)
        first_page = lo // size
        # Each row's pages from the one holding its first visible key; entries past a row's own
        # pages repeat its last one and are masked.
        span = int((-(-lengths // size) - first_page).max())
        cols = (first_page.unsqueeze(1) + torch.arange(span)).clamp_(max=max_pages - 1)
        sub = torch.gather(table, 1, cols)
        kvh, group, hd = self.num_kv_heads, self.group, self.head_dim
        keys = self._gather_pages(k_cache, sub.reshape(-1), size).view(kvh, nd, -1, hd)
        values = self._gather_pages(v_cache, sub.reshape(-1), size).view(kvh, nd, -1, hd)
        pos = first_page.unsqueeze(1) * size + torch.arange(span * size)
        visible = (pos >= lo.unsqueeze(1)) & (pos < lengths.unsqueeze(1))  # [nd, span * size]
        qg = q.view(nd, kvh, group, hd).transpose(0, 1)  # [kv_heads, nd, group, head_dim]
        probs = self._scores(qg, keys, visible.view(1, nd, 1, -1))
        return torch.matmul(probs, values).transpose(0, 1).reshape(nd, self.num_heads, hd)

    def _prefill(self, q, k_cache, v_cache, span: PrefillSpan, page_size: int,
                 out_dtype: torch.dtype | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        return self._window_prefill(q, k_cache, v_cache, span, page_size).to(out_dtype or q.dtype)

    def _window_prefill(self, q, k_cache, v_cache, span: PrefillSpan, page_size: int) -> torch.Tensor:
        offset = span.kv_len - span.q_len  # position of the chunk's first query
        first_page = int(self._first_visible(torch.tensor(offset))) // page_size
        start = first_page * page_size
        keys = self._gather_pages(k_cache, span.pages[first_page:], page_size)[:, : span.kv_len - start]
        values = self._gather_pages(v_cache, span.pages[first_page:], page_size)[:, : span.kv_len - start]
        q_pos = torch.arange(offset, span.kv_len).unsqueeze(1)
        k_pos = torch.arange(start, span.kv_len).unsqueeze(0)
        visible = k_pos <= q_pos
        if self.window is not None:
            visible &= k_pos > q_pos - self.window
        query = q.transpose(0, 1)  # [heads, q_len, head_dim]
        if self.softcap is None:
            out = F.scaled_dot_product_attention(query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                                 attn_mask=visible, enable_gqa=True, scale=self.sdpa_scale)
            return out.squeeze(0).transpose(0, 1)
        # SDPA has no soft-capping: scores by hand, K/V repeated per query head as transformers does.
        keys = keys.repeat_interleave(self.group, dim=0)
        values = values.repeat_interleave(self.group, dim=0)
        return torch.matmul(self._scores(query, keys, visible), values).transpose(0, 1)
