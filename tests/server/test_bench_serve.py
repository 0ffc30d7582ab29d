"""`tokenmill bench serve` pieces that need no server: workload, percentiles, summary."""

from __future__ import annotations

import pytest

from tokenmill.bench.serve import Sample, _summarize, make_prompts, percentile


def test_prompts_are_seeded_and_about_the_asked_length():
    assert make_prompts(3, 250, seed=1) == make_prompts(3, 250, seed=1)
    assert make_prompts(3, 250, seed=1) != make_prompts(3, 250, seed=2)
    assert all(len(p.split()) == 250 for p in make_prompts(3, 250, seed=1))


def test_shared_prefix_is_one_system_prompt_before_each_own_part():
    own = make_prompts(4, 30, seed=5)
    shared = make_prompts(4, 30, seed=5, shared_words=20)
    prefixes = {" ".join(p.split()[:20]) for p in shared}
    assert len(prefixes) == 1 and all(len(p.split()) == 50 for p in shared)
    assert [" ".join(p.split()[20:]) for p in shared] == own  # the own parts do not move
    assert prefixes != {" ".join(p.split()[:20]) for p in make_prompts(4, 30, seed=6, shared_words=20)}


def test_several_prefixes_are_dealt_out_in_turn():
    one = make_prompts(6, 30, seed=5, shared_words=20)
    three = make_prompts(6, 30, seed=5, shared_words=20, prefixes=3)
    heads = [" ".join(p.split()[:20]) for p in three]
    assert len(set(heads)) == 3 and heads[:3] == heads[3:]  # prompt i after prefix i % 3
    assert heads[0] == " ".join(one[0].split()[:20])  # the first is the one-prefix workload's
    assert [p.split()[20:] for p in three] == [p.split()[20:] for p in one]


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_summary_counts_errors_and_tokens():
    samples = [
        Sample(ok=True, ttft=0.5, itls=[0.1, 0.2], output_tokens=3, prompt_tokens=250),
        Sample(ok=True, ttft=1.5, itls=[0.3], output_tokens=2, prompt_tokens=252),
        Sample(ok=False, error="HTTP 503: busy"),
    ]
    s = _summarize(4, samples, seconds=2.0)
    assert (s["requests"], s["num_errors"], s["errors"]) == (3, 1, ["HTTP 503: busy"])
    assert s["output_tokens_per_s"] == pytest.approx(2.5)
    assert s["ttft_p50_s"] == pytest.approx(1.0) and s["itl_p50_s"] == pytest.approx(0.2)
    assert s["mean_prompt_tokens"] == pytest.approx(251)


def test_no_prefixes_is_a_usage_error(capsys):
    from tokenmill.entrypoints.cli import main

    argv = ["bench", "serve", "--url", "http://127.0.0.1:9", "--shared-prefix-words", "10", "--shared-prefixes", "0"]
    assert main(argv) == 2
    assert "--shared-prefixes must be >= 1, got 0" in capsys.readouterr().err
