"""Runs the model over one flat batch of token chunks and returns fp32 logits for sampling rows.

The runner knows nothing of requests: the engine hands it `SeqChunk`s (the tokens to compute for
one sequence this step, where they start, and the KV pages that sequence holds). It owns the K/V
tensors of the page pool and turns chunks into the flat tensors and attention metadata.

With a hybrid KV layout (kvcache/kv_groups.py) layers share `slots_per_page` K/V tensors, and each
sliding group's layers attend through that group's own pages (`SeqChunk.window_pages`): the metadata
then carries one AttentionMetadata per layer (`AttentionMetadata.for_layer`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.kvcache.kv_groups import KVLayout
from tokenmill.model.attention import AttentionMetadata, PrefillSpan
from tokenmill.model.config import ModelConfig
from tokenmill.model.kernels import weight_scratch
from tokenmill.model.kv_cache_format import EXACT_DEFAULT, KVCacheFormat
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.pooling import chunk_pool

# Chunks up to this many tokens are attended to as decode rows, one per token (speculative rows, short
# tails of prompts); longer ones through SDPA, whose per-chunk gather of the context then pays off.
# With `prefill_as_decode_rows` every chunk is: the C++ kernel computes runs of up to 16 rows of one
# sequence together, which measured 1.4x faster than SDPA's flash kernel for whole prompts
# (docs/benchmarks.md).
MAX_ROWS_AS_DECODE = 16
# Where the attention attends prompts in bf16 on AMX tiles (model/prompt_attention.py: fast
# mode on AMX), chunks of more than MAX_ROWS_AS_DECODE tokens go there when they have this many tokens,
# or when their attention (tokens x context) is this large; the rest stay runs of rows. Below 192 rows
# a prompt step is one fused C++ call (model/fused_decode.py), which measured 1.3-1.7x faster than the
# layers op by op with SDPA for fresh prompts of 32-191 tokens. From 192 rows both are op by op, and
# the tiles won: with our tile kernel (csrc/prompt_flash_amx.h) 107 against 112-115 ms at 192 tokens,
# 121-124 against 132 at 256 (torch's flash kernel was even with the rows at 256). After a cached
# prefix, SDPA won from ~200k token pairs (64 tokens after 4,000: 1.2x) in session 19; the rows have
# caught up since, and from 130k to 1.5M pairs the two are now within noise of each other
# (docs/benchmarks.md, "Prompt attention on AMX" and "Our own prompt attention on the tiles").
BF16_PROMPT_MIN_ROWS = 192
BF16_PROMPT_MIN_PAIRS = 196_608


@dataclass
class SeqChunk:
    token_ids: list[int]  # tokens to compute this step
    start: int  # position of token_ids[0] (= tokens whose K/V are already cached)
    pages: list[int]  # the sequence's KV pages, enough for start + len(token_ids) tokens
    sample: bool  # whether the last token's logits are needed
    # Logits for every token of the chunk, not just the last (prompt logprobs need them all).
    all_logits: bool = False
    # With sample: logits for this many trailing tokens. A speculative chunk (the last token, then
    # k draft tokens) needs k + 1 to verify its drafts.
    num_logits: int = 1
    # An embedding request's chunk: the runner also returns this chunk's part of the pooled final
    # hidden state ("last", "mean", "cls"; model/pooling.py). Such a chunk never samples.
    pooling_type: str | None = None
    # Hybrid KV layout only: the sequence's pages in each sliding group, aligned with `pages`; None
    # where the group holds none (wholly before its window: never read).
    window_pages: list[list[int | None]] | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_pages: int, page_size: int,
                 kv_format: KVCacheFormat | torch.dtype = EXACT_DEFAULT, prefill_as_decode_rows: bool = False,
                 kv_layout: KVLayout | None = None) -> None:
        self.model = model
        # Only where the C++ kernel reads the pages in place: the PyTorch path would pad every row.
        kernel = getattr(model.attention, "kernel", False)
        self.max_rows_as_decode = MAX_ROWS_AS_DECODE
        # Chunks of more than MAX_ROWS_AS_DECODE tokens (and at most max_rows_as_decode) whose attention
        # has this many token pairs go to the attention's bf16 prompt path instead of rows.
        self.prompt_path_min_pairs = 1 << 62
        if prefill_as_decode_rows and kernel:
            bf16_prompts = getattr(model.attention, "bf16_prompts", False)
            self.max_rows_as_decode = BF16_PROMPT_MIN_ROWS - 1 if bf16_prompts else 1 << 62
            self.prompt_path_min_pairs = BF16_PROMPT_MIN_PAIRS if bf16_prompts else 1 << 62
        self.page_size = page_size
        self.num_pages = num_pages
        kv_format = KVCacheFormat.of(kv_format) if isinstance(kv_format, torch.dtype) else kv_format
        self.kv_format = kv_format
        c: ModelConfig = model.config
        self.kv_layout = kv_layout or KVLayout.single(c.num_layers)
        self._placement = self.kv_layout.placement()
        slots = self.kv_layout.slots_per_page
        self.kv_bytes_per_token = self.token_bytes(model, kv_format, self.kv_layout)
        num_slots = num_pages * page_size
        # torch.empty: untouched pages cost no resident memory, so a large pool is cheap until used.
        # But attention reads whole pages, including slots not yet written, and uninitialised memory
        # may hold NaN (NaN * 0 in probs @ V is NaN). So pages are zeroed the first time any step
        # touches them; the free list hands out low page ids first, so a high-water mark suffices.
        self._zeroed_pages = 0
        self._kv_tensors = [
            (kv_format.allocate(c.num_kv_heads, num_slots, c.head_dim),
             kv_format.allocate(c.num_kv_heads, num_slots, c.head_dim))
            for _ in range(slots)
        ]
        # Per layer (the models zip their layers with it); layer j of every group shares slot j.
        self.kv_caches = [self._kv_tensors[slot] for _, slot in self._placement]

    @staticmethod
    def token_bytes(model: LlamaForCausalLM, kv_format: KVCacheFormat, kv_layout: KVLayout | None = None) -> int:
        """What one token's slot costs in the pool: this rank's KV heads, every layer of a KV group (so
        all layers unless the layout is hybrid). Stats and logs say it; a pool sized in bytes divides by it."""
        c: ModelConfig = model.config
        slots = (kv_layout or KVLayout.single(c.num_layers)).slots_per_page
        return kv_format.bytes_per_token(slots, c.num_kv_heads, c.head_dim)

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """fp32 logits, in the order of `chunks`: `num_logits` rows (usually 1) for each chunk with
        sample=True, one row per token for a chunk with all_logits=True (see _logit_rows)."""
        return self.execute_pooled(chunks)[0]

    @torch.inference_mode()
    def execute_pooled(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`execute`'s logits, and for each chunk with a `pooling_type`, in order, its part of the
        pooled final hidden state (after the final norm): one fp32 vector [hidden]."""
        # Decode rows first: attention batches them together (see attention.py).
        as_rows = [self.attends_as_rows(c) for c in chunks]
        order = sorted(range(len(chunks)), key=lambda i: not as_rows[i])
        ordered = [chunks[i] for i in order]
        input_ids, positions, meta, last_rows = self._prepare(ordered, sum(as_rows))
        hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        rows = self._logit_rows(chunks, order, last_rows)
        # every row in order (each decode step that samples all its rows): no gather
        logits = self.model.compute_logits(hidden if rows == list(range(hidden.shape[0]))
                                           else hidden[torch.tensor(rows, dtype=torch.long)])
        last = {i: last_rows[j] for j, i in enumerate(order)}
        pooled = [chunk_pool(hidden[last[i] - len(c.token_ids) + 1 : last[i] + 1], c.pooling_type)
                  for i, c in enumerate(chunks) if c.pooling_type is not None]
        return logits, pooled

    def attends_as_rows(self, chunk: SeqChunk) -> bool:
        """Whether the chunk's tokens attend as decode rows, one per token (the paged kernel), rather
        than as one prefill span."""
        n = len(chunk.token_ids)
        if n <= MAX_ROWS_AS_DECODE:
            return True
        return n <= self.max_rows_as_decode and n * (chunk.start + n) < self.prompt_path_min_pairs

    def release_idle_memory(self) -> None:
        """Drops what the steps keep between them and an idle engine does not need: the large steps'
        dense weight copies (kernels/weight_scratch.py; an 8B's gate/up pair is 235-470 MB)."""
        weight_scratch.release()

    def shutdown(self) -> None:
        """Nothing to release here; a tensor-parallel runner (parallel/runner.py) stops its other ranks."""

    # ---- one page's K/V as bytes: the prefix cache's disk tier (engine/kv_offload.py) ------------
    # Every cache tensor is indexed [kv_heads, slot, ...]: a page is slots page * page_size onwards.
    def page_layout(self) -> tuple[str, int]:
        parts, nbytes = [], 0
        for layer in self._kv_tensors:
            for t in layer:
                page = t[:, : self.page_size]
                parts.append(f"{page.dtype}{tuple(page.shape)}")
                nbytes += page.numel() * page.element_size()
        return ";".join([self.kv_format.layout_name] + parts), nbytes

    def read_page(self, page: int) -> bytes:
        lo, hi = page * self.page_size, (page + 1) * self.page_size
        return b"".join(t[:, lo:hi].contiguous().view(torch.uint8).numpy().tobytes()
                        for layer in self._kv_tensors for t in layer)

    def write_pages(self, pages: list[int], payloads: list[bytes]) -> None:
        """read_page's payloads written back into `pages`: one copy per cache tensor for all of them (a
        copy per page and tensor cost ~10 us of Python each: 150 ms for a 4,096-token prefix)."""
        if len(pages) != len(payloads):
            raise ValueError(f"{len(pages)} pages for {len(payloads)} payloads")
        if not pages:
            return
        self._zero_new_pages(max(pages) + 1)  # zeroing ahead later must not wipe what is written now
        size, n, page_bytes = self.page_size, len(pages), len(payloads[0])
        joined = bytearray(n * page_bytes)
        for i, payload in enumerate(payloads):
            joined[i * page_bytes:(i + 1) * page_bytes] = payload
        data = torch.frombuffer(joined, dtype=torch.uint8).view(n, page_bytes)
        index = torch.tensor(pages)
        offset = 0
        for layer in self._kv_tensors:
            for t in layer:
                heads, rest = t.shape[0], t.shape[2:]
                nbytes = heads * size * math.prod(rest) * t.element_size()
                # each payload's [heads, size, ...] of this tensor, read in place, into [heads, page, size, ...]
                part = data[:, offset:offset + nbytes].view(t.dtype).view(n, heads, size, *rest)
                t.view(heads, -1, size, *rest)[:, index] = part.transpose(0, 1)
                offset += nbytes

    def copy_page(self, src: int, dst: int) -> None:
        """Page `dst` becomes a copy of page `src`, every layer's K/V: a request whose prefix-cache match
        continues part way into a cached page starts its own page from it (engine/prefix_admission.py)."""
        self._zero_new_pages(max(src, dst) + 1)  # zeroing ahead later must not wipe the copy
        lo, hi = src * self.page_size, (src + 1) * self.page_size
        at = dst * self.page_size
        for layer in self._kv_tensors:
            for t in layer:
                t[:, at : at + self.page_size] = t[:, lo:hi]

    @staticmethod
    def _logit_rows(chunks: list[SeqChunk], order: list[int], last_rows: list[int]) -> list[int]:
        """Hidden rows to turn into logits, in the caller's chunk order: every row of an `all_logits`
        chunk (its last row is the sampling row when it samples), the last `num_logits` rows of a
        sampling chunk (a speculative chunk: its last token and the drafts after it)."""
        last = {i: last_rows[j] for j, i in enumerate(order)}
        rows: list[int] = []
        for i, c in enumerate(chunks):
            n = len(c.token_ids) if c.all_logits else c.num_logits if c.sample else 0
            rows.extend(range(last[i] - n + 1, last[i] + 1))
        return rows

    def _zero_new_pages(self, upto: int) -> None:
        if upto <= self._zeroed_pages:
            return
        # Zero ahead in big steps, so this happens a handful of times, not every step.
        upto = min(max(upto, 2 * self._zeroed_pages, 64), self.num_pages)
        start, end = self._zeroed_pages * self.page_size, upto * self.page_size
        for k_cache, v_cache in self._kv_tensors:
            k_cache[:, start:end].zero_()
            v_cache[:, start:end].zero_()
        self._zeroed_pages = upto

    def _prepare(self, chunks: list[SeqChunk], num_row_chunks: int):
        """The flat batch of `chunks`, whose first `num_row_chunks` attend as decode rows."""
        token_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        decode = chunks[:num_row_chunks]
        for c in chunks:
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + len(c.token_ids)))
            last_rows.append(len(token_ids) - 1)
        hybrid = self.kv_layout.is_hybrid
        groups = [[c.pages for c in chunks]]
        if hybrid:
            groups += [[self._window_pages(c, g) for c in chunks] for g in range(self.kv_layout.num_window_groups)]
        self._zero_new_pages(max(max(pages) for group in groups for pages in group) + 1)
        if len(decode) == len(chunks) and all(len(c.token_ids) == 1 for c in chunks):
            input_ids, positions_t, metas = self._one_token_rows_batch(token_ids, positions, groups)
        else:
            input_ids, positions_t = torch.tensor(token_ids), torch.tensor(positions)
            metas = [self._mixed_rows_meta(chunks, decode, pages) for pages in groups]
        if hybrid:
            metas[0].layer_metas = [metas[g] for g, _ in self._placement]
        return input_ids, positions_t, metas[0], last_rows

    @staticmethod
    def _window_pages(chunk: SeqChunk, group: int) -> list[int]:
        if chunk.window_pages is None:
            raise ValueError("this runner's KV cache is hybrid (sliding-window groups): every chunk needs "
                             "window_pages, one page list per sliding group")
        # Page 0 stands in for pages the group no longer holds: attention never reads them.
        return [0 if p is None else p for p in chunk.window_pages[group]]

    def _mixed_rows_meta(self, chunks: list[SeqChunk], decode: list[SeqChunk], pages_of: list[list[int]]) -> AttentionMetadata:
        """Block tables and slots for one KV group (`pages_of`: each chunk's pages in that group) of
        any step: decode chunks (first, each of up to max_rows_as_decode tokens) and prompt chunks.
        _prepare takes a step of one-token decode rows to _one_token_rows_batch instead."""
        size = self.page_size
        slot_parts: list[torch.Tensor] = []
        table = decode_mask = lengths = None
        nd = 0
        if decode:
            # Each token of a short chunk is a decode row of its own: the token at position p attends
            # to positions 0..p of its sequence, through the sequence's block table (the C++ kernel
            # reads pages in place; SDPA would gather the whole context per layer first).
            counts = torch.tensor([len(c.token_ids) for c in decode])
            nd = int(counts.sum())
            # row i of a chunk starting at `start` sees start + i + 1 positions
            first_rows = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
            starts = torch.repeat_interleave(torch.tensor([c.start for c in decode]), counts)
            lengths = starts + (torch.arange(nd) - first_rows) + 1
            max_pages = -(-max(c.start + len(c.token_ids) for c in decode) // size)
            page_rows = _block_table(pages_of[: len(decode)], max_pages)
            table = torch.tensor(page_rows).repeat_interleave(counts, dim=0)
            last = lengths - 1
            slot_parts.append(table[torch.arange(nd), last // size] * size + last % size)

        prefills: list[PrefillSpan] = []
        row = nd
        for c, chunk_pages in zip(chunks[len(decode):], pages_of[len(decode):]):
            kv_len = c.start + len(c.token_ids)
            pages = torch.tensor(chunk_pages[: -(-kv_len // size)])
            prefills.append(PrefillSpan(row, len(c.token_ids), kv_len, pages))
            pos = torch.arange(c.start, kv_len)
            slot_parts.append(pages[pos // size] * size + pos % size)
            row += len(c.token_ids)

        return AttentionMetadata(
            slot_mapping=torch.cat(slot_parts),
            num_decode=nd,
            page_size=size,
            decode_block_table=table,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_seq_lens=lengths,
        )

    def _one_token_rows_batch(self, token_ids: list[int], positions: list[int], groups: list[list[list[int]]]
                              ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """_prepare's tensors for a step of one-token decode rows: the ids, positions and each KV
        group's metadata (what _mixed_rows_meta builds for it, without its dozen small tensor ops) as
        views of one tensor built from one list. Such a step runs right after the weights' stream has
        emptied the caches, where each small tensor built costs ~10 us (a batch-1 token made 5 of
        them, Gemma 3's six KV groups 20: docs/benchmarks.md, session 29)."""
        size, n = self.page_size, len(token_ids)
        lengths = [p + 1 for p in positions]  # the token at position p sees p + 1 positions
        max_pages = -(-max(lengths) // size)
        flat = token_ids + positions + lengths
        for pages_of in groups:
            table = _block_table(pages_of, max_pages)
            flat += [row[(m - 1) // size] * size + (m - 1) % size for row, m in zip(table, lengths)]
            for row in table:
                flat += row
        buf = torch.tensor(flat)
        seq_lens = buf[2 * n : 3 * n]
        metas, at = [], 3 * n
        for _ in groups:
            slots, table_t = buf[at : at + n], buf[at + n : at + n + n * max_pages].view(n, max_pages)
            at += n + n * max_pages
            metas.append(AttentionMetadata(slot_mapping=slots, num_decode=n, page_size=size, decode_block_table=table_t,
                                           decode_mask=None, prefills=[], decode_seq_lens=seq_lens))
        return buf[:n], buf[n : 2 * n], metas


def _block_table(pages_of: list[list[int]], max_pages: int) -> list[list[int]]:
    """Each sequence's first `max_pages` pages, padded with page 0 (never read past a row's length)."""
    return [p[:max_pages] + [0] * (max_pages - len(p[:max_pages])) for p in pages_of]
