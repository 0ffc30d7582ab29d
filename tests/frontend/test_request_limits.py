"""The API's checks of a prompt against the engine's limits (frontend/request_limits.py), and the
engine's own (engine/admission.py): the same answers, including max_tokens left out."""

from __future__ import annotations

import pytest

from tests.engine.fake_runner import make_engine, run_to_completion
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.request_limits import check_prompt
from tokenmill.ipc.messages import SchedulerReady
from tokenmill.sample.sampling_params import SamplingParams

POOL = 64  # tokens: far under the context of 4,096


def limits() -> SchedulerReady:
    return SchedulerReady("m", max_model_len=4096, vocab_size=50, kv_capacity_tokens=POOL,
                          supports_cache_salt=True, supports_prompt_logprobs=True)


def test_left_out_max_tokens_is_what_the_pool_leaves_when_the_pool_is_smaller_than_the_context():
    check_prompt([1] * 10, SamplingParams(max_tokens=None), limits(), "prompt")  # no longer "10 + 4086 exceeds the KV cache"
    engine, _ = make_engine(50, max_model_len=4096, kv_cache_tokens=POOL, page_size=4)
    engine.add_request("r", [1] * 10, SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(run_to_completion(engine)["r"]) == POOL - 10
    assert engine.stats()["kv_pages_in_use"] == 0


def test_a_prompt_that_fills_the_pool_is_refused_by_both_naming_the_prompt():
    with pytest.raises(InvalidRequest, match="fills the KV cache") as api:
        check_prompt([1] * POOL, SamplingParams(max_tokens=None), limits(), "prompt")
    assert api.value.param == "prompt"
    engine, _ = make_engine(50, max_model_len=4096, kv_cache_tokens=POOL, page_size=4)
    with pytest.raises(InvalidRequest, match="fills the KV cache") as core:
        engine.add_request("r", [1] * POOL, SamplingParams(max_tokens=None))
    assert core.value.param == "prompt"


def test_an_explicit_max_tokens_past_the_pool_is_still_refused():
    with pytest.raises(InvalidRequest, match="exceeds the KV cache"):
        check_prompt([1] * 10, SamplingParams(max_tokens=POOL), limits(), "prompt")
    engine, _ = make_engine(50, max_model_len=4096, kv_cache_tokens=POOL, page_size=4)
    with pytest.raises(InvalidRequest, match="exceeds the KV cache"):
        engine.add_request("r", [1] * 10, SamplingParams(max_tokens=POOL))


def test_a_hybrid_pools_error_says_why_a_request_has_less_room_than_the_pool():
    note = "4096 token slots shared by 6 KV groups, ..."
    hybrid = SchedulerReady("m", max_model_len=32768, vocab_size=50, kv_capacity_tokens=680,
                            supports_cache_salt=True, supports_prompt_logprobs=True, kv_capacity_note=note)
    with pytest.raises(InvalidRequest, match=r"exceeds the KV cache \(680 tokens a request\); 4096 token slots shared by 6"):
        check_prompt([1] * 600, SamplingParams(max_tokens=100), hybrid, "prompt")
    with pytest.raises(InvalidRequest, match=r"exceeds the KV cache \(\d+ tokens a request\)$"):  # one group: nothing to add
        check_prompt([1] * 600, SamplingParams(max_tokens=POOL), limits(), "prompt")

