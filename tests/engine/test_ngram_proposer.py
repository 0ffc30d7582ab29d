"""The n-gram (prompt lookup) proposer: longest suffix first, most recent occurrence, at most k tokens."""

from __future__ import annotations

import numpy as np

from tokenmill.engine.request import Request
from tokenmill.engine.spec.ngram import NgramProposer, find_continuation
from tokenmill.sample.sampling_params import SamplingParams


def cont(tokens: list[int], min_n: int = 1, max_n: int = 3, k: int = 4) -> list[int]:
    return find_continuation(np.asarray(tokens, dtype=np.int64), min_n, max_n, k)


def test_proposes_what_followed_the_suffix():
    assert cont([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9, 1]
    assert cont([1, 2, 3, 4, 5, 9, 1, 2, 3], k=2) == [4, 5]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    # "2 3" occurred twice; "1 2 3" only in the first place, so that continuation is proposed.
    assert cont([1, 2, 3, 7, 8, 5, 2, 3, 6, 1, 2, 3]) == [7, 8, 5, 2]


def test_most_recent_occurrence_of_the_same_length():
    assert cont([4, 5, 1, 4, 5, 2, 4, 5], min_n=2, max_n=2, k=1) == [2]


def test_nothing_below_min_n_and_short_tails():
    assert cont([1, 2, 3, 4], min_n=1) == []  # no token repeats
    assert cont([1, 2, 9, 1, 2], min_n=3) == []  # only a 2-gram repeats
    assert cont([1, 2, 3, 5, 1, 2, 3], min_n=2, k=5) == [5, 1, 2, 3]  # fewer than k tokens follow
    assert cont([7]) == []


def test_short_matches_propose_as_many_tokens_as_they_matched():
    assert cont([7, 1, 2, 3, 4, 5, 6, 7], min_n=1, k=4) == [1]  # one token matched: one draft
    assert cont([8, 7, 1, 2, 3, 4, 8, 7], min_n=1, k=4) == [1, 2]
    assert cont([9, 8, 7, 1, 2, 3, 4, 9, 8, 7], min_n=1, k=4) == [1, 2, 3, 4]  # TRUSTED_MATCH: all k


def test_proposer_reads_prompt_and_output():
    r = Request("r", [9, 10, 11, 12, 13, 10], SamplingParams(), max_tokens=8)
    r.append_output(11)
    r.append_output(12)
    proposer = NgramProposer(2, 4)
    assert proposer.propose([r], [3]) == [[13, 10, 11]]
    assert proposer.propose([r], [0]) == [[]]
