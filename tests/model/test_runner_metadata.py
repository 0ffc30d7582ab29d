"""The runner's attention metadata for a step of one-token decode rows (its list-built fast path)
equals what the general path builds for the same chunks, tensor for tensor."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.model.runner import ModelRunner, SeqChunk


def _runner(page_size: int) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # the metadata needs the page size alone
    runner.page_size = page_size
    return runner


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(4))
def test_one_token_rows_equal_the_general_path(page_size, seed):
    rng = random.Random(seed)
    chunks, pages_of = [], []
    for _ in range(rng.randint(1, 9)):
        start = rng.randint(0, 70)  # positions before the token: page boundaries and a first token
        pages = rng.sample(range(200), -(-(start + 1) // page_size) + rng.randint(0, 2))  # spare pages too
        chunks.append(SeqChunk([rng.randrange(100)], start, pages, sample=True))
        pages_of.append(pages)
    runner = _runner(page_size)
    fast = runner._group_meta(chunks, chunks, pages_of)
    general = runner._mixed_rows_meta(chunks, chunks, pages_of)
    for name in ("slot_mapping", "decode_block_table", "decode_seq_lens"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (fast.num_decode, fast.page_size, fast.decode_mask, fast.prefills) == (
        general.num_decode, general.page_size, general.decode_mask, general.prefills)


def test_a_step_with_a_longer_chunk_takes_the_general_path():
    runner = _runner(16)
    chunks = [SeqChunk([5], 3, [7], sample=True), SeqChunk([1, 2], 20, [4, 9], sample=True)]
    meta = runner._group_meta(chunks, chunks, [c.pages for c in chunks])
    assert meta.num_decode == 3 and meta.decode_seq_lens.tolist() == [4, 21, 22]
    assert meta.slot_mapping.tolist() == [7 * 16 + 3, 9 * 16 + 4, 9 * 16 + 5]
