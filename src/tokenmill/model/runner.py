"""Runs the model over one flat batch of token chunks and returns fp32 logits for sampling rows.

The runner knows nothing of requests: the engine hands it `SeqChunk`s (the tokens to compute for
one sequence this step, where they start, and the KV pages that sequence holds). It owns the K/V
tensors of the page pool and turns chunks into the flat tensors and attention metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.model.attention import AttentionMetadata, PrefillSpan
from tokenmill.model.config import ModelConfig
from tokenmill.model.llama import LlamaForCausalLM


@dataclass
class SeqChunk:
    token_ids: list[int]  # tokens to compute this step
    start: int  # position of token_ids[0] (= tokens whose K/V are already cached)
    pages: list[int]  # the sequence's KV pages, enough for start + len(token_ids) tokens
    sample: bool  # whether the last token's logits are needed


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_pages: int, page_size: int) -> None:
        self.model = model
        self.page_size = page_size
        c: ModelConfig = model.config
        num_slots = num_pages * page_size
        # torch.empty: untouched pages cost no resident memory, so a large pool is cheap until used.
        self.kv_caches = [
            (
                torch.empty(num_slots, c.num_kv_heads, c.head_dim),
                torch.empty(num_slots, c.num_kv_heads, c.head_dim),
            )
            for _ in range(c.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits [number of chunks with sample=True, vocab], in the order of `chunks`."""
        # Decode rows first: attention batches them together (see attention.py).
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
        ordered = [chunks[i] for i in order]
        input_ids, positions, meta, last_rows = self._prepare(ordered)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        sample_rows = [last_rows[j] for j, i in enumerate(order) if chunks[i].sample]
        sampled_in_order = [i for i in order if chunks[i].sample]
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, dtype=torch.long)])
        # Back to the caller's chunk order.
        restore = sorted(range(len(sampled_in_order)), key=lambda j: sampled_in_order[j])
        return logits[torch.tensor(restore, dtype=torch.long)] if restore != list(range(len(restore))) else logits

    def _prepare(self, chunks: list[SeqChunk]):
        size = self.page_size
        token_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        decode = [c for c in chunks if len(c.token_ids) == 1]
        for c in chunks:
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + len(c.token_ids)))
            last_rows.append(len(token_ids) - 1)
        slot_parts: list[torch.Tensor] = []

        decode_slots = decode_mask = None
        if decode:
            nd = len(decode)
            lengths = torch.tensor([c.start + 1 for c in decode])
            max_len = int(lengths.max())
            max_pages = -(-max_len // size)
            table = torch.tensor([c.pages[:max_pages] + [0] * (max_pages - len(c.pages[:max_pages])) for c in decode])
            pos = torch.arange(max_len)
            decode_slots = table[:, pos // size] * size + pos % size  # [nd, max_len]
            valid = pos.unsqueeze(0) < lengths.unsqueeze(1)
            decode_mask = torch.zeros(nd, max_len).masked_fill_(~valid, float("-inf")).view(nd, 1, 1, max_len)
            slot_parts.append(decode_slots[torch.arange(nd), lengths - 1])

        prefills: list[PrefillSpan] = []
        row = len(decode)
        for c in chunks[len(decode):]:
            kv_len = c.start + len(c.token_ids)
            pos = torch.arange(kv_len)
            pages = torch.tensor(c.pages[: -(-kv_len // size)])
            kv_slots = pages[pos // size] * size + pos % size
            prefills.append(PrefillSpan(row, len(c.token_ids), kv_len, kv_slots))
            slot_parts.append(kv_slots[c.start:])
            row += len(c.token_ids)

        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts),
            num_decode=len(decode),
            decode_kv_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
        )
        return torch.tensor(token_ids), torch.tensor(positions), meta, last_rows
