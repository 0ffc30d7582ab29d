"""The runner's attention metadata for a step of one-token decode rows (its fast path: views of one
tensor built from one list) equals what the general path builds for the same chunks, tensor for tensor,
in every KV group."""

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
    _, _, (fast,) = runner._one_token_rows_batch([c.token_ids[0] for c in chunks], [c.start for c in chunks], [pages_of])
    general = runner._mixed_rows_meta(chunks, chunks, pages_of)
    for name in ("slot_mapping", "decode_block_table", "decode_seq_lens"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (fast.num_decode, fast.page_size, fast.decode_mask, fast.prefills) == (
        general.num_decode, general.page_size, general.decode_mask, general.prefills)


def test_the_general_path_with_a_longer_chunk():
    runner = _runner(16)
    chunks = [SeqChunk([5], 3, [7], sample=True), SeqChunk([1, 2], 20, [4, 9], sample=True)]
    meta = runner._mixed_rows_meta(chunks, chunks, [c.pages for c in chunks])
    assert meta.num_decode == 3 and meta.decode_seq_lens.tolist() == [4, 21, 22]
    assert meta.slot_mapping.tolist() == [7 * 16 + 3, 9 * 16 + 4, 9 * 16 + 5]


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_one_token_batch_views_equal_each_groups_general_path(groups, seed):
    # _prepare's one-token step: ids, positions and every KV group's tensors as views of one tensor
    rng = random.Random(seed)
    runner = _runner(16)
    chunks = []
    for _ in range(rng.randint(1, 9)):
        start = rng.randint(0, 70)
        chunks.append(SeqChunk([rng.randrange(100)], start, rng.sample(range(200), -(-(start + 1) // 16)), sample=True))
    # other groups: each chunk's own page ids there (sliding groups hold other pages, 0 for dropped ones)
    page_lists = [[c.pages for c in chunks]] + [[[rng.choice([0, rng.randrange(200)]) for _ in c.pages] for c in chunks]
                                                for _ in range(groups - 1)]
    ids, positions, metas = runner._one_token_rows_batch([c.token_ids[0] for c in chunks], [c.start for c in chunks],
                                                         page_lists)
    assert ids.tolist() == [c.token_ids[0] for c in chunks] and positions.tolist() == [c.start for c in chunks]
    assert len(metas) == groups
    for meta, pages_of in zip(metas, page_lists):
        general = runner._mixed_rows_meta(chunks, chunks, pages_of)
        for name in ("slot_mapping", "decode_block_table", "decode_seq_lens"):
            a, b = getattr(meta, name), getattr(general, name)
            assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b), name
        assert (meta.num_decode, meta.decode_mask, meta.prefills) == (len(chunks), None, [])
