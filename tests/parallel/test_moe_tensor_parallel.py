"""Tensor parallelism of mixture-of-experts models: each expert (and the shared expert) split like a
dense MLP, the router whole on every rank, one all-reduce per MoE block. TP=2 gives one rank's greedy
tokens in exact mode; sizes that cut an expert's width are refused naming what works."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import SamplingParams

PROMPTS = [[17, 300, 4021, 99, 12000, 7, 7, 42] * 3, [5, 6, 7], [1000 + i for i in range(30)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_two_ranks_give_one_ranks_greedy_tokens(tmp_path, arch):
    folder = str(make_tiny_model(tmp_path, arch))
    args = dict(precision="exact", kv_cache_tokens=2048, max_num_batched_tokens=24)
    one = LLM(folder, num_threads=1, **args)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    with LLM(folder, num_threads=2, tensor_parallel_size=2, **args) as two:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY)] == expected


def test_a_size_that_cuts_the_experts_is_refused(tmp_path):
    # 4 heads, 4 KV heads and the dense MLP's 128 divide by 4, experts 42 wide do not
    folder = str(make_tiny_model(tmp_path, "qwen3_moe", moe_intermediate_size=42, num_key_value_heads=4))
    with pytest.raises(InvalidRequest) as e:
        LLM(folder, precision="exact", num_threads=1, tensor_parallel_size=4)
    assert "expert intermediate size (42)" in str(e.value) and "sizes that work for this model: 1, 2" in str(e.value)
