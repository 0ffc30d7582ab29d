"""`LLM(data_parallel_size=N)`: N engine processes behind the offline API. Outputs come back in the
caller's order with the same greedy tokens as one engine, every replica gets a share, and the
replicas' counters and integrity checks are reachable."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill.entrypoints.llm import LLM, DataParallelLLM
from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [f"prompt number {i} " * (1 + i % 4) for i in range(7)]


def test_two_replicas_answer_like_one_engine_in_the_callers_order(tmp_path):
    folder = str(make_tiny_model(tmp_path, "llama"))
    one = LLM(folder, precision="exact", num_threads=1, kv_cache_tokens=2048)
    expected = one.generate(PROMPTS, GREEDY)
    vectors = one.embed(PROMPTS)
    with LLM(folder, precision="exact", num_threads=2, kv_cache_tokens=2048, data_parallel_size=2) as llm:
        assert isinstance(llm, DataParallelLLM) and isinstance(llm, LLM)
        got = llm.generate(PROMPTS, [GREEDY] * 6 + [SamplingParams(temperature=0.0, max_tokens=8, n=2)])
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        assert [o.prompt for o in got] == PROMPTS
        assert len(got[-1].outputs) == 2 and got[-1].outputs[1].token_ids == got[-1].outputs[0].token_ids
        assert len({o.request_id for o in got}) == len(PROMPTS)
        stats = llm.stats()
        assert len(stats["replicas"]) == 2
        assert all(s["generation_tokens_total"] > 0 for s in stats["replicas"]), "a replica got no share"
        # embeddings too, spread over both replicas, in the caller's order (exact mode: the same bits)
        assert llm.embed(PROMPTS) == vectors
        assert all(s["pooling_requests_total"] > 0 for s in llm.stats()["replicas"])
        llm.check_integrity()
        with pytest.raises(InvalidRequest, match="stream"):
            next(iter(llm.stream("hi")))


def test_bad_sizes_fail_before_any_replica_starts():
    with pytest.raises(InvalidRequest, match="data_parallel_size must be an integer >= 1"):
        LLM(data_parallel_size=0)
    with pytest.raises(InvalidRequest, match="unknown engine argument") as info:
        LLM(data_parallel_size=2, no_such_setting=1)
    assert info.value.param == "no_such_setting"
