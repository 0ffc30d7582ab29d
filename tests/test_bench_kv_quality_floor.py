"""`python -m tokenmill.bench.kv_quality_floor`'s pieces: its simulated int8 rows must be the numbers the
shipped int8 format decodes to (else the group-size comparison measures something else), and its
statistics must count agreement, near-ties and the interval right."""

from __future__ import annotations

import pytest
import torch

from tokenmill.bench.kv_quality_floor import NEAR_TIE, PairStats, fake_int8, wilson
from tokenmill.model.kv_cache_format import KVCacheFormat


def test_simulated_row_scale_is_the_int8_format_exactly():
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0] = 0.0  # an all-zero row: scale 0, no division by zero
    fmt = KVCacheFormat.named("int8")
    assert torch.equal(fake_int8(x, 64), fmt.decode(fmt.encode(x)))


def test_smaller_groups_round_each_group_on_its_own_scale():
    x = torch.cat([torch.full((32,), 0.01), torch.full((32,), 100.0)]).view(1, 64)
    assert torch.allclose(fake_int8(x, 32, rotated=False), x, rtol=1e-6)  # each half exact on its own scale
    assert fake_int8(x, 64, rotated=False)[0, 0] == 0.0  # one scale for both: the small half rounds to zero
    # rotated (the shipped rows), an outlier channel no longer costs the others their levels
    y = torch.randn(50, 64, generator=torch.Generator().manual_seed(1))
    y[:, 3] *= 40
    err = {r: (fake_int8(y, 64, rotated=r) - y).pow(2).mean() for r in (False, True)}
    assert err[True] < 0.3 * err[False]


def test_pair_stats_count_disagreements_and_near_ties():
    ref = torch.tensor([[2.0, 1.0, 0.0], [1.0, 1.0 - NEAR_TIE / 2, 0.0], [0.0, 3.0, 1.0]])
    cand = torch.tensor([[2.0, 1.0, 0.0], [0.9, 1.0, 0.0], [3.0, 0.0, 1.0]])
    stats = PairStats()
    stats.add(ref, cand)
    s = stats.summary()
    assert (s["positions"], s["disagreements"], s["near_tie_disagreements"]) == (3, 2, 1)
    assert s["top1"] == pytest.approx(1 / 3) and s["top1_without_near_ties"] == pytest.approx(1 / 2)
    assert s["kl_mean"] > 0


def test_wilson_interval():
    lo, hi = wilson(990, 1000)
    assert lo == pytest.approx(0.9817, abs=1e-4) and hi == pytest.approx(0.9946, abs=1e-4)
    assert wilson(50, 100)[0] < 0.5 < wilson(50, 100)[1]
