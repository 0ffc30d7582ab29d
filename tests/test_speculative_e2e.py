"""Speculative decoding on the bundled model: greedy output token-identical to transformers (exact
mode) with n-gram and draft proposers, alone, batched, chunked, preempted; structured output, stop
strings and logprobs unchanged by it; nothing left held when idle."""

from __future__ import annotations

import json

import pytest

from tests.real_model import make_llm
from tests.test_fidelity import assert_all_match, cases
from tokenmill.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def ngram(k: int, **kw) -> dict:
    # disable_by_batch_size above the batch: every row of these tests speculates.
    return {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": 64, **kw}


def assert_idle(llm) -> None:
    llm.check_integrity()
    stats = llm.stats()
    assert stats["kv_pages_in_use"] == 0 and stats["num_requests_running"] == 0
    if llm.engine.proposer is not None:
        llm.engine.proposer.check_idle()


# k=3: several drafts a row, partly rejected; a longer k runs the same verification path on more rows
# (k=4 under chunked prefill and preemption below), and k=1 (a single draft) runs one row a step below.
def test_ngram_greedy_matches_transformers():
    llm = make_llm(speculative=ngram(3))
    assert_all_match(llm, cases())
    stats = llm.stats()
    # The repetitive prompts do get drafts accepted: the test exercises multi-token steps.
    assert stats["spec_decode_num_accepted_tokens_total"] > 10
    assert_idle(llm)


def test_ngram_under_chunked_prefill_and_preemption():
    # A small budget chunks prompts and verification rows share steps with prefill chunks; a small
    # pool preempts requests in the middle of speculating.
    llm = make_llm(speculative=ngram(4), max_num_batched_tokens=64, kv_cache_tokens=768)
    assert_all_match(llm, cases())
    assert llm.stats()["num_preemptions"] > 0
    assert_idle(llm)


def test_draft_model_greedy_matches_transformers():
    # The most useful CPU case: the target's own weights, quantized, drafting for exact fp32.
    spec = {"method": "draft", "num_speculative_tokens": 3, "draft_precision": "fast", "draft_quantization": "int8",
            "disable_by_batch_size": 64}
    llm = make_llm(speculative=spec)
    assert_all_match(llm, cases()[:4])
    stats = llm.stats()
    assert stats["spec_decode_acceptance_rate"] > 0.5  # the same model: it agrees nearly always
    assert_idle(llm)


@pytest.fixture(scope="module")
def pair():
    return make_llm(kv_cache_tokens=8192), make_llm(kv_cache_tokens=8192, speculative=ngram(4))


def test_stop_strings_logprobs_and_penalties_unchanged(pair):
    off, on = pair
    prompt = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(12)) + " Item 12:"
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop=["lazy dog. Item 14"]),
        SamplingParams(temperature=0, max_tokens=24, logprobs=3),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.2, frequency_penalty=0.3),
    ]
    a = off.generate([prompt] * 3, params)
    b = on.generate([prompt] * 3, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason
    assert a[0].outputs[0].finish_reason == "stop"
    lp_off, lp_on = a[1].outputs[0].logprobs, b[1].outputs[0].logprobs
    assert len(lp_on) == len(b[1].outputs[0].token_ids)  # one entry per accepted token
    for x, y in zip(lp_off, lp_on):
        assert (x.token_id, x.rank) == (y.token_id, y.rank)
        assert abs(x.logprob - y.logprob) < 1e-3
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert on.stats()["spec_decode_num_accepted_tokens_total"] > 0
    assert_idle(on)


def test_structured_output_unchanged(pair):
    pytest.importorskip("xgrammar")
    from tokenmill.sample.sampling_params import StructuredOutputParams

    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"},
                                                         "maxItems": 6}}, "required": ["items"]}
    chat = [{"role": "user", "content": "List six fruits as JSON, in an object with the key items."}]
    params = [SamplingParams(temperature=0, max_tokens=120, structured_output=StructuredOutputParams(json_schema=schema)),
              SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutputParams(regex=r"(ab){1,20}c"))]
    off, on = pair  # the pair of the test above: its drafts are counted before this one's
    drafted = on.stats()["spec_decode_num_draft_tokens_total"]
    a = off.chat([chat, [{"role": "user", "content": "Write abababab."}]], params)
    b = on.chat([chat, [{"role": "user", "content": "Write abababab."}]], params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
    json.loads(b[0].outputs[0].text)
    assert on.stats()["spec_decode_num_draft_tokens_total"] > drafted
    assert_idle(on)
    assert not on.engine.grammars.active()


def test_ngram_each_prompt_alone():
    # One row a step with a single draft (k=1): the prompts whose own text the n-grams find (code, the
    # long list, the number sequence) and a chat; the other prompts draft rarely and run the same path
    # as above.
    llm = make_llm(speculative=ngram(1))
    for i in (2, 4, 5, 7):
        assert_all_match(llm, [cases()[i]])
    # One draft a step at most: each accepted one is a step of two tokens (7 in 64 tokens measured).
    assert llm.stats()["spec_decode_num_accepted_tokens_total"] > 4
    assert_idle(llm)
