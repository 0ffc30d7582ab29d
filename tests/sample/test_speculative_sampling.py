"""Verification of draft tokens (sample/speculative.py): the accepted run, row histories, grammar rows,
and the distribution of what speculative steps emit (chi-square against the exact distribution)."""

from __future__ import annotations

import pytest
import torch

from tests.sample.test_sampler_stats import chi2_critical, reference
from tokenmill.sample.sampler import Sampler
from tokenmill.sample.sampling_params import SamplingParams
from tokenmill.sample.speculative import DraftPositionMatcher, accepted_run, verification_batch


def test_accepted_run():
    assert accepted_run([5], []) == [5]
    assert accepted_run([1, 2, 3, 9], [1, 2, 3]) == [1, 2, 3, 9]  # all accepted + the bonus token
    assert accepted_run([1, 7, 3, 9], [1, 2, 3]) == [1, 7]  # the target's token replaces the first miss
    assert accepted_run([4, 2, 3, 9], [1, 2, 3]) == [4]
    with pytest.raises(ValueError, match="2 drafts need 3"):
        accepted_run([1, 2], [1, 2])


def test_rows_see_the_drafts_before_them():
    out = [7, 8]
    batch = verification_batch(
        [SamplingParams(presence_penalty=1.0)], [None], [[1, 2]], [out], [[3, 4]], None
    )
    assert batch.output_token_ids == [[7, 8], [7, 8, 3], [7, 8, 3, 4]]
    assert batch.output_token_ids[0] is out  # the penalty history follows this list across steps
    assert batch.matchers is None and len(batch) == 3


class RecordingMatcher:
    """A fake grammar: refuses token 0, terminates on token 9; records what the mask was filled after."""

    backend = object()

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.filled_after: list[list[int]] = []

    def accept_token(self, token: int) -> bool:
        if token == 0:
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == 9

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n :]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.filled_after.append(list(self.accepted))


def test_grammar_rows_advance_through_the_drafts_and_roll_back():
    m = RecordingMatcher()
    m.accepted = [5]
    batch = verification_batch([SamplingParams()], [None], [[1]], [[5]], [[3, 4, 0, 6]], [m])
    rows = batch.matchers
    assert rows[0] is m and all(isinstance(r, DraftPositionMatcher) for r in rows[1:])
    for i, r in enumerate(rows):
        r.fill_bitmask(torch.empty(0), i)
    # Row j after drafts[:j]; a refused draft (0) stops the advance: later rows keep [5, 3, 4].
    assert m.filled_after == [[5], [5, 3], [5, 3, 4], [5, 3, 4], [5, 3, 4]]
    assert m.accepted == [5]  # nothing unverified stays in the matcher
    m2 = RecordingMatcher()
    DraftPositionMatcher(m2, [2, 9]).fill_bitmask(torch.empty(0), 0)
    assert m2.filled_after == [[2]] and m2.accepted == []  # nothing is masked after the structure ends


TRIALS = 20000


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)])
def test_emitted_tokens_follow_the_non_speculative_distribution(params):
    """Two positions: the first emitted token must follow P0 whatever the draft; the second, emitted
    only after the draft was accepted, must follow P1 (the distribution after the draft)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    l0 = torch.randn(vocab, generator=gen) * 1.5
    l1 = torch.randn(vocab, generator=gen) * 1.5
    draft = int(torch.argsort(l0, descending=True)[1])  # a plausible but not the likeliest guess
    logits = torch.stack([l0, l1]).repeat(TRIALS, 1)
    batch = verification_batch(
        [params] * TRIALS, [None] * TRIALS, [[1]] * TRIALS, [[]] * TRIALS, [[draft]] * TRIALS, None
    )
    tokens = Sampler(vocab, eos_token_ids=[], seed=3)(logits, batch).token_ids.view(TRIALS, 2).tolist()
    runs = [accepted_run(t, [draft]) for t in tokens]
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=vocab)
    second = torch.bincount(torch.tensor([r[1] for r in runs if len(r) == 2]), minlength=vocab)
    for counts, lg in ((first, l0), (second, l1)):
        expected = reference(lg, params.temperature, 0, params.top_p, 0.0) * counts.sum()
        live = expected > 0
        assert counts[~live].sum() == 0  # never a token the filters remove
        chi2 = (((counts[live] - expected[live]) ** 2) / expected[live]).sum().item()
        assert chi2 < chi2_critical(int(live.sum()) - 1), chi2
    assert 0 < second.sum() < TRIALS


def test_greedy_rows_accept_exactly_the_argmax_run():
    l0 = torch.tensor([0.0, 3.0, 1.0])
    l1 = torch.tensor([2.0, 0.0, 1.0])
    l2 = torch.tensor([0.0, 0.0, 5.0])
    batch = verification_batch([SamplingParams(temperature=0)], [None], [[1]], [[]], [[1, 0]], None)
    tokens = Sampler(3, eos_token_ids=[])(torch.stack([l0, l1, l2]), batch).token_ids.tolist()
    assert accepted_run(tokens, [1, 0]) == [1, 0, 2]
