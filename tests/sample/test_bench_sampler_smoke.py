"""The benchmark keeps running (a tiny size, not timed)."""

from __future__ import annotations

import pytest

from .bench_sampler import MODES, bench_sampler


@pytest.mark.parametrize("mode", list(MODES))
def test_bench_runs(mode: str) -> None:
    assert bench_sampler(rows=4, vocab=512, iters=2, mode=mode, threads=None, prompt_len=8, output_len=4) > 0
