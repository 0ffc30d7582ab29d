"""Sampling on the bundled model: logprobs and prompt logprobs against transformers, and seeded
requests that give the same tokens alone, in a batch and after a preemption."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.real_model import hf_model, make_llm
from tokenmill.engine.engine_core import EngineCore
from tokenmill.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

TOL = 1e-4  # exact (fp32) mode against transformers' fp32 forward


@pytest.fixture(scope="module")
def llm():
    # A small step budget: a 40-token prompt is prefilled in three chunks.
    return make_llm(kv_cache_tokens=4096, max_num_batched_tokens=16)


@functools.lru_cache(maxsize=4)
def hf_logprobs(ids: tuple[int, ...]) -> torch.Tensor:
    """log_softmax of transformers' logits: row q is the distribution of token q + 1."""
    with torch.inference_mode():
        logits = hf_model()(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def prompt_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text)


def assert_top_sorted_and_matching(top: list[tuple[int, float]], ref_row: torch.Tensor, n: int) -> None:
    assert len(top) == n
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    ref_top = ref_row.topk(n)
    assert max(abs(a - b) for a, b in zip(values, ref_top.values.tolist())) < TOL
    for token_id, value in top:
        assert abs(value - ref_row[token_id].item()) < TOL


def test_greedy_logprobs_equal_transformers_max_log_softmax(llm):
    ids = prompt_ids(llm, "The history of the printing press begins")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=8,
                                                                  ignore_eos=True, logprobs=5))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    ref = hf_logprobs(tuple(ids + out.token_ids))
    for j, (token_id, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(ids) - 1 + j]
        assert lp.token_id == token_id and lp.rank == 1
        assert abs(lp.logprob - row.max().item()) < TOL  # greedy: the sampled token is the most likely
        assert lp.top[0][0] == token_id  # and it comes first in the top-N
        assert_top_sorted_and_matching(lp.top, row, 5)


@pytest.mark.parametrize("warm_cache", [False, True])
def test_prompt_logprobs_equal_transformers(llm, warm_cache):
    ids = prompt_ids(llm, "Paris is the capital of France, and Berlin is the capital of Germany. "
                          "Rome is the capital of Italy, Lisbon is the capital of Portugal, "
                          "and Madrid is the capital of")
    assert len(ids) > 32  # several 16-token chunks and two full pages
    llm.reset_prefix_cache()
    if warm_cache:  # the prompt is in the prefix cache, whose pages have K/V but no logits
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1))
    before = llm.stats()["prompt_tokens_computed_total"]
    result = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))[0]
    assert llm.stats()["prompt_tokens_computed_total"] - before == len(ids)  # the whole prompt, cache or not
    entries = result.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    ref = hf_logprobs(tuple(ids))
    for i in range(1, len(ids)):
        lp, row = entries[i], ref[i - 1]
        assert lp.token_id == ids[i]
        assert abs(lp.logprob - row[ids[i]].item()) < TOL
        assert lp.rank == int((row >= row[ids[i]]).sum())
        assert_top_sorted_and_matching(lp.top, row, 3)
    # Prompt logprobs do not disturb the completion itself.
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert result.outputs[0].token_ids == plain.outputs[0].token_ids


def test_prompt_logprobs_with_n_samples(llm):
    ids = prompt_ids(llm, "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve")
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3, prompt_logprobs=0)
    result = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert len(result.outputs) == 3 and len(result.prompt_logprobs) == len(ids)
    assert all(e.top == [] for e in result.prompt_logprobs[1:])  # prompt_logprobs=0: the token's own only


# ---- reproducibility --------------------------------------------------------------------------------
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
TARGET = "Once upon a time, in a small village by the sea, there"


def run_engine(engine: EngineCore, requests: list[tuple[str, list[int], SamplingParams]], watch: str):
    """Runs requests to the end on the engine itself; returns the tokens of each and `watch`'s Request."""
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    watched = engine.requests[watch]
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens, watched


def test_seeded_request_alone_batched_and_preempted_gives_the_same_tokens(llm):
    target = prompt_ids(llm, TARGET)
    alone = llm.generate({"prompt_token_ids": target}, SEEDED)[0].outputs[0].token_ids
    assert len(alone) == 10
    # In a batch of 16 others: greedy, unseeded, other seeds, other lengths, penalties.
    others = [f"Prompt number {i} is about {topic}" for i, topic in enumerate(["cats", "rain", "maths", "jazz"] * 4)]
    other_params = [
        SamplingParams(temperature=[0.0, 0.7, 1.3, 1.0][i % 4], seed=[None, None, 99, i][i % 4],
                       max_tokens=4 + i % 9, ignore_eos=True, top_k=[-1, 20][i % 2],
                       presence_penalty=0.5 * (i % 3 == 0))
        for i in range(16)
    ]
    llm.reset_prefix_cache()
    outs = llm.generate(others[:8] + [{"prompt_token_ids": target}] + others[8:],
                        other_params[:8] + [SEEDED] + other_params[8:])
    assert outs[8].outputs[0].token_ids == alone

    # After a preemption: a 4-page pool. Three 14-token prompts fit one page each, then each needs a
    # second page at position 16; the newest (the target) is preempted and later recomputes.
    tiny = make_llm(kv_cache_tokens=64, num_threads=2)
    fillers = [prompt_ids(llm, f"A short story about {w}, told in simple words")[:14] for w in ("dogs", "ships")]
    short_target = target[:14]
    want = llm.generate({"prompt_token_ids": short_target}, SEEDED)[0].outputs[0].token_ids
    requests = [("f0", fillers[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
                ("f1", fillers[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
                ("target", short_target, SEEDED)]
    tokens, watched = run_engine(tiny.engine, requests, "target")
    assert watched.num_preemptions >= 1
    assert tokens["target"] == want
    tiny.check_integrity()
