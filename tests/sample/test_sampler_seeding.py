"""Seeded rows reproduce whatever shares their batch; greedy rows are plain argmax and draw nothing."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sample.sampler import Sampler
from tokenmill.sample.sampling_batch import SamplingBatch
from tokenmill.sample.sampling_params import SamplingParams

VOCAB = 300
STEPS = 12
FILTERS = {
    "plain": dict(temperature=0.9),
    "top_k": dict(temperature=1.1, top_k=20),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(min_p=0.05),
    "all": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, presence_penalty=0.5),
    # Fewer finite logits than top_k: -inf candidates must not shift a seeded row's draws.
    "banned": dict(top_k=50, bad_words_token_ids=list(range(10, VOCAB))),
}


def step_logits(step: int, rows: int, salt: int) -> torch.Tensor:
    """Row 0 is the same for every salt (the request under test); the other rows vary."""
    g = torch.Generator().manual_seed(1000 + step)
    target = torch.randn(1, VOCAB, generator=g) * 2
    others = torch.randn(rows - 1, VOCAB, generator=torch.Generator().manual_seed(salt * 97 + step)) * 2
    return torch.cat([target, others])


def run(params: SamplingParams, seed: int, others: int, index: int, engine_seed: int) -> list[int]:
    """Generate STEPS tokens for one seeded request placed at `index` among `others` other rows."""
    sampler = Sampler(VOCAB, [], seed=engine_seed)
    gen = torch.Generator().manual_seed(seed)
    other_params = [SamplingParams(**FILTERS[k]) for k in FILTERS] + [SamplingParams(temperature=0.0)]
    other_gens = [torch.Generator().manual_seed(77 + j) if j % 3 == 0 else None for j in range(others)]
    output: list[int] = []
    other_outputs: list[list[int]] = [[] for _ in range(others)]
    for step in range(STEPS):
        logits = step_logits(step, others + 1, salt=engine_seed)
        order = list(range(1, others + 1))
        order.insert(index, 0)  # row 0 of `logits` lands at `index`
        batch = SamplingBatch(
            params=[params if r == 0 else other_params[(r - 1) % len(other_params)] for r in order],
            generators=[gen if r == 0 else other_gens[r - 1] for r in order],
            prompt_token_ids=[[1, 2, 3]] * (others + 1),
            output_token_ids=[output if r == 0 else other_outputs[r - 1] for r in order],
        )
        tokens = sampler(logits[order], batch).token_ids.tolist()
        output.append(tokens[index])
        for pos, r in enumerate(order):
            if r:
                other_outputs[r - 1].append(tokens[pos])
    return output


@pytest.mark.parametrize("name", list(FILTERS))
def test_seeded_row_ignores_its_batch(name: str) -> None:
    params = SamplingParams(seed=42, **FILTERS[name])
    alone = run(params, seed=42, others=0, index=0, engine_seed=1)
    crowded = run(params, seed=42, others=16, index=9, engine_seed=2)
    assert alone == crowded
    assert len(set(alone)) > 1  # really sampled, not stuck on one token


@pytest.mark.parametrize("name", ["plain", "all"])
def test_different_seeds_differ(name: str) -> None:
    a = run(SamplingParams(**FILTERS[name]), seed=1, others=0, index=0, engine_seed=1)
    b = run(SamplingParams(**FILTERS[name]), seed=2, others=0, index=0, engine_seed=1)
    assert a != b


def test_greedy_rows_are_argmax_whatever_the_batch() -> None:
    greedy = SamplingParams(temperature=0.0)
    logits = torch.randn(17, VOCAB, generator=torch.Generator().manual_seed(5))
    alone = Sampler(VOCAB, [])(logits[:1], SamplingBatch([greedy], [None], [[]], [[]])).token_ids
    params = [greedy if i % 2 == 0 else SamplingParams(**FILTERS["all"]) for i in range(17)]
    mixed = Sampler(VOCAB, [], seed=3)(logits, SamplingBatch(params, [None] * 17, [[]] * 17, [[]] * 17))
    tokens = mixed.token_ids
    assert tokens[0] == alone[0] == logits[0].argmax()
    assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))
    assert tokens.dtype == torch.int64 and tokens.shape == (17,)


def test_greedy_rows_draw_no_randomness() -> None:
    # Unseeded random rows get the same engine noise with or without greedy rows among them.
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(9))
    hot = [SamplingParams(temperature=1.0), SamplingParams(top_k=50)]
    p_random = [hot[i % 2] for i in range(4)]
    only_random = Sampler(VOCAB, [], seed=11)(
        logits[1::2], SamplingBatch(p_random, [None] * 4, [[]] * 4, [[]] * 4)
    )
    p_mixed = [SamplingParams(temperature=0.0) if i % 2 == 0 else hot[(i // 2) % 2] for i in range(8)]
    mixed = Sampler(VOCAB, [], seed=11)(logits, SamplingBatch(p_mixed, [None] * 8, [[]] * 8, [[]] * 8))
    assert torch.equal(mixed.token_ids[1::2], only_random.token_ids)


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=1e-6)
    out = Sampler(VOCAB, [], seed=0)(logits, SamplingBatch([p] * 4, [None] * 4, [[]] * 4, [[]] * 4))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_wider_logits_than_vocab() -> None:
    # Padded lm_head: the logits' own width is what is sampled over.
    logits = torch.full((2, 64), -10.0)
    logits[:, 60] = 10.0
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=3)]
    out = Sampler(50, [], seed=0)(logits, SamplingBatch(params, [None] * 2, [[]] * 2, [[]] * 2))
    assert out.token_ids.tolist() == [60, 60]


@pytest.mark.parametrize("vocab", [4096, 5000, 49152])
@pytest.mark.parametrize("k", [1, 7, 16])
def test_blocked_topk_equals_topk(vocab: int, k: int) -> None:
    from tokenmill.sample.logprobs import fast_topk as _topk

    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab + k)) * 3
    x[0, -1] = 100.0  # the best logit in the ragged tail
    x[1, :] = x[1, 0]  # all tied
    vals, ids = _topk(x, k)
    ref_vals, ref_ids = x.topk(k, dim=-1)
    assert torch.equal(vals, ref_vals)
    assert torch.equal(x.gather(1, ids), vals)
    assert torch.equal(ids[2:], ref_ids[2:])  # no ties there: same ids too
    assert all(len(set(row)) == k for row in ids.tolist())


@pytest.mark.parametrize("vocab", [300, 4096, 5000, 262_144 + 77])
def test_fast_argmax_equals_argmax(vocab: int) -> None:
    from tokenmill.sample.logprobs import fast_argmax

    x = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab))
    x[0, -1] = 50.0  # only in the ragged tail
    x[1, 7] = x[1, 300 % vocab - 1] = x[1, -1] = 60.0  # ties: the first wins
    x[2, :] = float("-inf")
    x[3, 5] = x[3, 9] = float("nan")  # the first NaN, whatever the maximum
    x[3, 7] = 1e30
    x[4, :] = 1.0
    x[5, 64] = x[5, 65] = x[5, vocab // 2] = 9.0  # ties, near and far
    x[6, 63] = x[6, 64] = 9.0
    assert torch.equal(fast_argmax(x), x.argmax(dim=-1))
    finite = x[[0, 1, 2, 4, 5, 6, 7]]
    assert torch.equal(fast_argmax(finite), finite.argmax(dim=-1))
    for row in range(8):  # one row at a time, as a batch-1 decode step samples
        assert torch.equal(fast_argmax(x[row : row + 1]), x[row : row + 1].argmax(dim=-1)), row
    strided = x[:, ::3]
    assert torch.equal(fast_argmax(strided), strided.argmax(dim=-1))
    half = x.to(torch.bfloat16)  # not numpy's: torch's own argmax
    assert torch.equal(fast_argmax(half), half.argmax(dim=-1))
    assert fast_argmax(x).dtype == torch.int64
