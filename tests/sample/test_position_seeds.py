"""Output-position generators of seeded requests (sample/position_seeds.py)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sample.position_seeds import position_generator, position_seed
from tokenmill.sample.sampling_params import SamplingParams
from tokenmill.sample.speculative import verification_batch


def draws(seed: int, position: int) -> list[float]:
    return torch.rand(4, generator=position_generator(seed, position)).tolist()


def test_same_seed_and_position_same_draws_and_every_other_pair_differs():
    assert draws(7, 3) == draws(7, 3)
    keys = {position_seed(seed, pos) for seed in (0, 1, 2, 7, -1, 2**40) for pos in range(50)}
    assert len(keys) == 6 * 50
    assert all(0 <= k < 2**32 for k in keys)


def test_seeds_that_differ_only_above_bit_31_give_different_streams():
    # torch's CPU generator keeps a seed's low 32 bits: 0 and 2**32 were the same stream.
    assert torch.equal(torch.rand(3, generator=torch.Generator().manual_seed(0)),
                       torch.rand(3, generator=torch.Generator().manual_seed(2**32)))
    for a, b in ((0, 2**32), (1, 2**32 + 1), (-1, 2**63 - 1), (-(2**63), 0)):
        assert draws(a, 0) != draws(b, 0)


def test_a_negative_position_is_refused():
    with pytest.raises(ValueError, match="output position"):
        position_seed(1, -1)


def test_verification_rows_draw_from_their_own_positions():
    # Row j of a request with 5 output tokens samples output position 5 + j; an unseeded one has none.
    batch = verification_batch(
        [SamplingParams(seed=9), SamplingParams()], [9, None], [[1], [1]], [[2] * 5, [3]], [[4, 4], [5]], None
    )
    seeded, unseeded = batch.generators[:3], batch.generators[3:]
    assert [torch.rand(4, generator=g).tolist() for g in seeded] == [draws(9, p) for p in (5, 6, 7)]
    assert unseeded == [None, None]
