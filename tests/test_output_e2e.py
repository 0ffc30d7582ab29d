"""The output side on the bundled model: each way a request ends, what it returns and counts, and
that a stop string found by the frontend stops the engine and frees the KV within the step."""

from __future__ import annotations

import pytest

from tests.real_model import make_llm
from tokenmill.frontend.output_state import RequestOutputState
from tokenmill.sample.sampling_params import OutputKind, SamplingParams

pytestmark = pytest.mark.slow

COUNTING = "1, 2, 3, 4, 5,"


@pytest.fixture(scope="module")
def llm():
    return make_llm(kv_cache_tokens=4096)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def counting(llm):
    """The greedy continuation of COUNTING with nothing stopping it: " 6, 7, 8, ..."."""
    out = llm.generate(COUNTING, greedy(16, ignore_eos=True))[0].outputs[0]
    assert " 7," in out.text
    return out


def test_stop_string_stops_the_engine_and_frees_kv_within_the_step(llm, counting):
    engine = llm.engine
    prompt = llm.tokenizer.encode(COUNTING)
    other = llm.tokenizer.encode("Write a long story about a dragon.")
    params = greedy(16, ignore_eos=True, stop=[" 7,"], output_kind=OutputKind.DELTA)
    states = {
        "stopper": RequestOutputState("stopper", llm.tokenizer, prompt, params),
        "other": RequestOutputState("other", llm.tokenizer, other, greedy(20, ignore_eos=True)),
    }
    engine.add_request("stopper", prompt, params)
    engine.add_request("other", other, states["other"].params)
    before = engine.stats()["generation_tokens_total"]
    made = {"stopper": 0, "other": 0}
    streamed = []
    stopped_at = None
    while engine.has_unfinished():
        for out in engine.step():
            assert stopped_at is None or out.request_id != "stopper", "generated after its stop string"
            made[out.request_id] += len(out.new_token_ids)
            delta = llm._apply(states[out.request_id], out)  # what LLM.generate / LLM.stream do
            if out.request_id == "stopper" and delta is not None:
                streamed.append(delta.text)
                if delta.stop_hit:
                    stopped_at = engine.num_steps
        if stopped_at == engine.num_steps:
            # The same step: the request is gone and only `other` holds pages.
            assert "stopper" not in engine.requests
            live = engine.scheduler.running
            assert [r.request_id for r in live] == ["other"]
            assert engine.stats()["kv_pages_in_use"] == len(live[0].pages) - live[0].num_tree_pages
            engine.check_integrity()
    state = states["stopper"]
    assert stopped_at is not None and state.finish_reason == "stop" and state.stop_reason == " 7,"
    assert "".join(streamed) == state.text == counting.text[: counting.text.index(" 7,")]
    # Returned tokens end with the one that completed the stop string; nothing after it was made.
    ids = state.token_ids
    assert " 7," in llm.tokenizer.decode(ids) and " 7," not in llm.tokenizer.decode(ids[:-1])
    assert made["stopper"] == len(ids) < 16
    assert engine.stats()["generation_tokens_total"] - before == made["stopper"] + made["other"]
    assert engine.stats()["kv_pages_in_use"] == 0


def test_finish_and_stop_reason_of_each_stop_kind(llm, counting):
    chat_ids = llm.chat_prompt_ids([{"role": "user", "content": "Say hello."}])
    # A stop token id that first appears at position j of the greedy continuation.
    j = next(i for i, t in enumerate(counting.token_ids) if i >= 2 and t not in counting.token_ids[:i])
    stop_id = counting.token_ids[j]
    before = llm.stats()["generation_tokens_total"]
    eos, stop_token, stop_string, length = llm.generate(
        [{"prompt_token_ids": chat_ids}, COUNTING, COUNTING, COUNTING],
        [
            greedy(64),
            greedy(16, ignore_eos=True, stop_token_ids=[stop_id]),
            greedy(16, ignore_eos=True, stop=[" 7,"]),
            greedy(5, ignore_eos=True),
        ],
    )
    out = eos.outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids and "<|im_end|>" not in out.text
    out = stop_token.outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == counting.token_ids[: j + 1]  # the stop token is returned, its text is not
    assert out.text == llm.tokenizer.decode(counting.token_ids[:j])
    out = stop_string.outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", " 7,")
    assert out.text == counting.text[: counting.text.index(" 7,")]
    out = length.outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    assert out.token_ids == counting.token_ids[:5]
    # Usage counts exactly the returned tokens, and the engine generated no others.
    results = [eos, stop_token, stop_string, length]
    for r in results:
        assert r.num_completion_tokens == len(r.outputs[0].token_ids)
    assert llm.stats()["generation_tokens_total"] - before == sum(r.num_completion_tokens for r in results)
    assert llm.stats()["kv_pages_in_use"] == 0


def test_abort_ends_with_abort_and_frees_kv(llm):
    engine = llm.engine
    ids = llm.tokenizer.encode("Tell me about the moon.")
    params = greedy(30, ignore_eos=True)
    state = RequestOutputState("gone", llm.tokenizer, ids, params)
    engine.add_request("gone", ids, params)
    for _ in range(3):
        for out in engine.step():
            llm._apply(state, out)
    assert engine.stats()["kv_pages_in_use"] > 0
    assert engine.abort_request("gone") and not engine.abort_request("gone")  # a second abort is harmless
    final = state.update([], "abort")  # what the server's scheduler sends the detokenizer
    assert (final.finish_reason, final.stop_reason, final.num_output_tokens) == ("abort", None, 3)
    assert not engine.has_unfinished() and engine.stats()["kv_pages_in_use"] == 0
    # A stream the consumer drops is aborted too.
    stream = llm.stream("Tell me about the sun.", greedy(30, ignore_eos=True))
    next(stream)
    assert engine.stats()["kv_pages_in_use"] > 0
    stream.close()
    assert not engine.has_unfinished() and engine.stats()["kv_pages_in_use"] == 0


def test_the_offline_api_goes_through_request_output_state(llm, monkeypatch):
    calls = []
    update = RequestOutputState.update

    def counting_update(self, new_token_ids, finished_reason=None):
        calls.append(self.request_id)
        return update(self, new_token_ids, finished_reason)

    monkeypatch.setattr(RequestOutputState, "update", counting_update)
    before = llm.stats()["generation_tokens_total"]
    results = llm.generate(["a b c", "x y z"], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3,
                                                              ignore_eos=True))
    # One update per engine output (one token each): every returned token went through it.
    assert len(calls) == llm.stats()["generation_tokens_total"] - before == 12
    assert len(set(calls)) == 4 and sum(r.num_completion_tokens for r in results) == 12
