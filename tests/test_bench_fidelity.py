"""`tokenmill bench fidelity` on a tiny random-weight Gemma 3 (a sliding window of 8 tokens, pages of
4): every run of the command is token-identical to transformers and really exercises what it names
(prefix hits, preemptions); a wrong reference token fails its prompt in every run; prompts are cut as
the command says."""

from __future__ import annotations

import argparse

import pytest

from tests.tiny_models import GEMMA_WINDOW, make_tiny_model, reference_model
from tokenmill.bench.fidelity import run_fidelity, slice_prompts, token_lengths, transformers_greedy
from tokenmill.errors import InvalidRequest

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3", tokenizer=False)
    # Shorter and longer than the window, one of them past two chunks of the runs' 96-token budget.
    prompts = slice_prompts(list(range(100, 500)), [3, 2 * GEMMA_WINDOW + 5, 7 * GEMMA_WINDOW, 230], lead=[2])
    return str(folder), prompts, transformers_greedy(reference_model(folder), prompts, NEW_TOKENS)


def test_slices_are_consecutive_after_the_lead_and_bad_lengths_are_refused():
    assert slice_prompts(list(range(10)), [3, 4], lead=[99]) == [[99, 0, 1], [99, 2, 3, 4]]
    assert slice_prompts(list(range(10)), [2, 3], lead=[]) == [[0, 1], [2, 3, 4]]
    with pytest.raises(InvalidRequest, match="cannot cut a 6-token prompt: the held-out text has 10 tokens"):
        slice_prompts(list(range(10)), [5, 6], lead=[])
    assert token_lengths("8,360") == [8, 360]
    for bad in ("8,x", "1,5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            token_lengths(bad)


def test_every_run_matches_transformers_and_exercises_its_case(tiny):
    model, prompts, refs = tiny
    runs = run_fidelity(model, prompts, refs, NEW_TOKENS, {"page_size": 4, "num_threads": 1}, log=lambda _: None)
    names = ["all together", "each alone, again: from the prefix cache", "each alone, cold",
             "all together in chunks of 96 tokens", "in chunks of 59, a pool of"]  # 59: a quarter of 230 + 6
    assert len(runs) == len(names) and all(r.name.startswith(n) for r, n in zip(runs, names)), [r.name for r in runs]
    for r in runs:
        assert r.matches == [True] * len(prompts) and r.passed, r
    cached, cold, preempted = runs[1], runs[2], runs[4]
    assert cached.prefix_hit_tokens > 0 and cold.prefix_hit_tokens == 0
    assert preempted.preemptions > 0 and "preempted" in preempted.name


def test_a_wrong_reference_fails_that_prompt_in_every_run(tiny):
    model, prompts, refs = tiny
    wrong = [list(r) for r in refs]
    wrong[3][-1] = (wrong[3][-1] + 1) % 1000
    runs = run_fidelity(model, prompts, wrong, NEW_TOKENS, {"page_size": 4, "num_threads": 1}, log=lambda _: None)
    for r in runs:
        assert r.matches == [True, True, True, False] and not r.passed
