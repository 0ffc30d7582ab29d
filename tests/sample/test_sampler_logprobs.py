"""Logprobs describe the raw model distribution: values, ranks, top lists; prompt logprobs."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sample import logprobs as logprobs_mod
from tokenmill.sample.logprobs import TokenLogprobs, prompt_logprobs
from tokenmill.sample.sampler import Sampler
from tokenmill.sample.sampling_batch import SamplingBatch
from tokenmill.sample.sampling_params import SamplingParams

VOCAB = 200


def check(lp: TokenLogprobs, raw_row: torch.Tensor, n: int) -> None:
    ref = torch.log_softmax(raw_row, dim=-1)
    assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=1e-5)
    assert lp.rank == 1 + int((ref > ref[lp.token_id]).sum())
    assert len(lp.top) == n
    values = [v for _, v in lp.top]
    assert values == sorted(values, reverse=True)
    assert [t for t, _ in lp.top] == ref.topk(n).indices.tolist()
    for t, v in lp.top:
        assert v == pytest.approx(ref[t].item(), abs=1e-5)


def test_sampled_logprobs_are_raw() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(logprobs=5, temperature=0.0),
        SamplingParams(logprobs=20, temperature=0.5, top_k=10, presence_penalty=2.0),
        SamplingParams(logprobs=0, top_p=0.5, logit_bias={7: 100.0}),  # token 7 is sampled, raw logprob low
        SamplingParams(),  # no logprobs asked
        SamplingParams(logprobs=3, seed=1, min_p=0.2, repetition_penalty=1.7),
        SamplingParams(logprobs=1, bad_words_token_ids=[int(logits[5].argmax())], temperature=0.0),
    ]
    gens = [None, None, None, None, torch.Generator().manual_seed(1), None]
    batch = SamplingBatch(params, gens, [[1, 2]] * 6, [[3, 4, 5]] * 6)
    out = Sampler(VOCAB, [0])(logits, batch)
    assert out.logprobs[3] is None
    for i, n in [(0, 5), (1, 20), (2, 0), (4, 3), (5, 1)]:
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i].item()
        check(lp, logits[i], n)
    assert out.logprobs[0].rank == 1  # greedy without processors picks the top token
    assert out.logprobs[2].token_id == 7
    assert out.logprobs[5].rank == 2  # greedy, but its best token was banned


def test_prompt_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logprobs_mod, "_PROMPT_CHUNK", 3)  # several chunks
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(2))
    targets = torch.tensor([5, 0, 199, 17, 17, 3, 42, 8])
    out = prompt_logprobs(logits, targets, top_n=4)
    assert [lp.token_id for lp in out] == targets.tolist()
    for lp, row in zip(out, logits):
        check(lp, row, 4)


def test_rank_with_ties_is_vllm_style() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    [lp] = prompt_logprobs(logits, torch.tensor([2]), top_n=2)
    assert lp.rank == 2  # tokens with logprob >= the chosen one's, itself included
