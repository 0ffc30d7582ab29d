"""min_tokens, bad words, logit bias and penalties change logits exactly as their formulas say."""

from __future__ import annotations

import math

import torch

from tokenmill.sample.penalties import LogitsProcessors
from tokenmill.sample.sampler import Sampler
from tokenmill.sample.sampling_batch import SamplingBatch, plan_batch
from tokenmill.sample.sampling_params import SamplingParams

INF = math.inf
ROW = [1.0, -2.0, 3.0, 0.5, -1.0, 2.0]


def process(
    rows: list[list[float]],
    params: list[SamplingParams],
    prompts,
    outputs,
    eos=(5,),
    procs: LogitsProcessors | None = None,
) -> list[list[float]]:
    logits = torch.tensor(rows)
    batch = SamplingBatch(params, [None] * len(params), prompts, outputs)
    (procs or LogitsProcessors(eos))(logits, batch, plan_batch(batch))
    return logits.tolist()


def test_penalties_formulas() -> None:
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    [out] = process([ROW], [p], [[0, 1]], [[2, 2, 3]])
    # 0, 1 in the prompt only: repetition alone (positive divided, negative multiplied).
    # 2 twice in the output: 3/2 - 0.5*2 - 0.25; 3 once: 0.5/2 - 0.5 - 0.25. 4 and 5 untouched.
    assert out == [0.5, -4.0, 0.25, -0.5, -1.0, 2.0]


def test_frequency_and_presence_ignore_the_prompt() -> None:
    p = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)
    [out] = process([ROW], [p], [[0, 1, 2]], [[3, 3, 3]])
    assert out == [1.0, -2.0, 3.0, 0.5 - 3.0 - 0.5, -1.0, 2.0]


def test_negative_penalties_reward() -> None:
    p = SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0)
    [out] = process([ROW], [p], [[]], [[4]])
    assert out[4] == -1.0 + 1.0 + 2.0


def test_bias_then_penalty_order() -> None:
    # Bias first: token 1 is -2 + 3 = 1 > 0 when the repetition penalty sees it, so it is divided.
    p = SamplingParams(repetition_penalty=2.0, logit_bias={1: 3.0, 4: -0.5})
    [out] = process([ROW], [p], [[1]], [[]])
    assert out == [1.0, 0.5, 3.0, 0.5, -1.5, 2.0]


def test_bad_words_and_min_tokens() -> None:
    params = [
        SamplingParams(bad_words_token_ids=[0, 3]),
        SamplingParams(min_tokens=3, stop_token_ids=[2]),
        SamplingParams(min_tokens=3, stop_token_ids=[2]),  # already has 3 outputs: nothing masked
        SamplingParams(min_tokens=2, ignore_eos=True),  # vLLM masks EOS even then
    ]
    outs = process([ROW] * 4, params, [[]] * 4, [[], [1, 1], [1, 1, 1], []])
    assert outs[0] == [-INF, -2.0, 3.0, -INF, -1.0, 2.0]
    assert outs[1] == [1.0, -2.0, -INF, 0.5, -1.0, -INF]
    assert outs[2] == ROW
    assert outs[3] == [1.0, -2.0, 3.0, 0.5, -1.0, -INF]


def test_rows_are_independent() -> None:
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0, logit_bias={0: 1.0}), SamplingParams()]
    outs = process([ROW] * 3, params, [[]] * 3, [[], [2], [2]])
    assert outs[0] == ROW and outs[2] == ROW
    assert outs[1] == [2.0, -2.0, 2.0, 0.5, -1.0, 2.0]


def test_history_follows_appends_and_rebuilds() -> None:
    # The per-request history is cached on the output list's identity: appending to the same list,
    # handing a new list, or shortening it must all give what a fresh computation gives.
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    procs = LogitsProcessors([5])
    prompt, output = [0, 1], []
    rows = [[float(v) for v in range(-3, 3)]]
    for tok in [2, 2, 4, 1, 2, 3]:
        output.append(tok)
        cached = process(rows, [p], [prompt], [output], procs=procs)
        fresh = process(rows, [p], [prompt], [list(output)])
        assert cached == fresh
    output[:] = output[:2]
    assert process(rows, [p], [prompt], [output], procs=procs) == process(rows, [p], [prompt], [list(output)])
    output[-1] = 4  # same length, changed tail
    assert process(rows, [p], [prompt], [output], procs=procs) == process(rows, [p], [prompt], [list(output)])


def test_greedy_respects_min_tokens_and_bad_words() -> None:
    sampler = Sampler(6, eos_token_ids=[5])
    logits = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 9.0]])
    p = SamplingParams(temperature=0.0, min_tokens=2, bad_words_token_ids=[2])
    tokens = [sampler(logits, SamplingBatch([p], [None], [[]], [[7] * n])).token_ids.item() for n in range(3)]
    assert tokens == [0, 0, 5]  # 5 (EOS) masked until 2 outputs exist; 2 is banned; ties -> first


def test_bad_words_never_sampled() -> None:
    sampler = Sampler(8, eos_token_ids=[], seed=3)
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]).expand(4000, -1).contiguous()
    p = SamplingParams(temperature=1.5, bad_words_token_ids=[0, 1])
    batch = SamplingBatch([p] * 4000, [None] * 4000, [[]] * 4000, [[]] * 4000)
    tokens = sampler(logits, batch).token_ids
    assert not ((tokens == 0) | (tokens == 1)).any()
    assert len(tokens.unique()) == 6


def test_caller_logits_untouched() -> None:
    sampler = Sampler(6, eos_token_ids=[5])
    logits = torch.tensor([ROW])
    p = SamplingParams(temperature=0.7, presence_penalty=1.0, logit_bias={0: 5.0}, min_p=0.1, top_k=3)
    sampler(logits, SamplingBatch([p], [None], [[]], [[2]]))
    assert logits.tolist() == [ROW]


def test_ids_beyond_the_logits_are_ignored() -> None:
    # Prompt / stop / bias ids past the logits' width (a narrower head than the tokenizer) do nothing.
    p = SamplingParams(repetition_penalty=2.0, min_tokens=1, stop_token_ids=[99], logit_bias={98: 1.0})
    [out] = process([ROW], [p], [[0, 97]], [[]], eos=(5, 96))
    assert out == [0.5, -2.0, 3.0, 0.5, -1.0, -INF]


def test_empty_batch() -> None:
    out = Sampler(10, [2])(torch.zeros(0, 10), SamplingBatch([], [], [], []))
    assert out.token_ids.shape == (0,) and out.logprobs == []
