"""OpenAI request bodies -> SamplingParams, and every failure -> an OpenAI error body (no processes)."""

from __future__ import annotations

import msgspec
import pydantic
import pytest

from tokenmill.entrypoints.openai.errors import as_request_error, error_body, validation_message
from tokenmill.entrypoints.openai.params import (
    MAX_N,
    chat_sampling_params,
    completion_sampling_params,
    echo_only,
)
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.sequences import child_params
from tokenmill.frontend.tokenizer_manager import RequestError
from tokenmill.ipc.messages import AddRequest, ToScheduler
from tokenmill.sample.sampling_params import OutputKind, SamplingParams

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> SamplingParams:
    return chat_sampling_params(ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields}))


def completion(**fields) -> SamplingParams:
    return completion_sampling_params(CompletionRequest.model_validate({"prompt": "hi", **fields}))


def test_defaults_follow_openai():
    p = chat()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (1, 1.0, 1.0, -1, None, None)
    assert p.output_kind is OutputKind.DELTA
    assert completion().max_tokens == 16  # the completions API's own default
    assert completion(max_tokens=None).max_tokens is None  # explicit null: up to the context length


def test_every_sampling_field_is_passed_through():
    p = completion(
        n=3, max_tokens=7, temperature=0.5, top_p=0.9, stop=["x", "y"], seed=11, presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={"42": 5}, logprobs=3, user="u", top_k=20, min_p=0.1,
        repetition_penalty=1.2, min_tokens=2, ignore_eos=True, stop_token_ids=[9], include_stop_str_in_output=True,
        skip_special_tokens=False, spaces_between_special_tokens=False, priority=-2,
    )
    assert p.priority == -2 and chat(priority=3).priority == 3
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.stop_strings, p.seed) == (3, 7, 0.5, 0.9, ["x", "y"], 11)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.logprobs) == (0.5, -0.5, {42: 5.0}, 3)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens, p.ignore_eos) == (20, 0.1, 1.2, 2, True)
    assert (p.stop_token_ids, p.include_stop_str_in_output, p.skip_special_tokens) == ([9], True, False)
    assert p.spaces_between_special_tokens is False


def test_chat_max_completion_tokens_wins_and_logprobs_map_to_top_n():
    assert chat(max_tokens=5, max_completion_tokens=9).max_tokens == 9
    assert chat(max_tokens=5).max_tokens == 5
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).logprobs == 4


def test_child_params_of_n_samples():
    p = completion(n=3, seed=100, prompt_logprobs=2)
    assert [child_params(p, k).seed for k in range(3)] == [100, 101, 102]
    assert all(child_params(p, k).n == 1 for k in range(3))
    assert child_params(completion(n=2), 1).seed is None
    # The prompt's logprobs are computed once, by sample 0, unless each sample needs its own.
    assert [child_params(p, k).prompt_logprobs for k in range(3)] == [2, None, None]
    assert child_params(p, 2, all_prompt_logprobs=True).prompt_logprobs == 2


def test_echo_with_logprobs_scores_the_prompt():
    p = completion(echo=True, logprobs=2)
    assert (p.logprobs, p.prompt_logprobs) == (2, 2)
    assert completion(logprobs=2).prompt_logprobs is None
    assert completion(prompt_logprobs=3).prompt_logprobs == 3
    # lm-eval's loglikelihood: echo, max_tokens 0: the engine samples one token, the server drops it.
    req = CompletionRequest.model_validate({"prompt": "hi", "echo": True, "max_tokens": 0, "logprobs": 1})
    assert completion_sampling_params(req).max_tokens == 1 and echo_only(req)
    assert not echo_only(CompletionRequest.model_validate({"prompt": "hi", "echo": True}))


@pytest.mark.parametrize(
    ("build", "param"),
    [
        (lambda: chat(top_logprobs=2), "top_logprobs"),
        (lambda: chat(logprobs=True, top_logprobs=21), "top_logprobs"),  # the field the client sent
        (lambda: chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
        (lambda: chat(response_format={"type": "yaml"}), "response_format"),
        (lambda: chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
        (lambda: completion(guided_choice=[]), "guided_choice"),
        (lambda: completion(guided_json={"type": "object"}, guided_regex="a"), "guided_regex"),
        (lambda: chat(tool_choice="required"), "tool_choice"),
        (lambda: completion(temperature=-1), "temperature"),
        (lambda: completion(top_p=0), "top_p"),
        (lambda: completion(n=0), "n"),
        (lambda: completion(n=MAX_N + 1), "n"),
        (lambda: completion(max_tokens=0), "max_tokens"),
        (lambda: completion(presence_penalty=3), "presence_penalty"),
        (lambda: completion(logit_bias={"abc": 1}), "logit_bias"),
        (lambda: completion(logit_bias={"5": 500}), "logit_bias"),
        (lambda: completion(stop=""), "stop"),
        (lambda: completion(suffix="!"), "suffix"),
        (lambda: completion(best_of=3), "best_of"),
        (lambda: chat(prompt_logprobs=1), "prompt_logprobs"),  # completions only
        (lambda: completion(cache_salt=""), "cache_salt"),
    ],
)
def test_out_of_range_fields_are_400_naming_the_field(build, param):
    with pytest.raises(InvalidRequest) as info:
        build()
    err = as_request_error(info.value)
    assert (err.status, err.param) == (400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": "x", "temperature": "hot"}', "temperature"),
        ('{"prompt": "x", "max_tokens": 1.5}', "max_tokens"),
        ('{"prompt": "x", "n": true}', "n"),  # strict: a boolean is not an integer
        ('{"prompt": "x", "stream": "yes"}', "stream"),
        ('{"prompt": "x", "seed": 99999999999999999999999}', "seed"),
        ('{"prompt": [1, "a"]}', "prompt"),
        ('{"prompt": "x", "stop_token_ids": [-1]}', "stop_token_ids"),
        ('{"prompt": "x", "priority": 0.5}', "priority"),
        ('{"temperature": 0}', "prompt"),
    ],
)
def test_wrong_types_are_400_naming_the_field(body, param):
    with pytest.raises(pydantic.ValidationError) as info:
        CompletionRequest.model_validate_json(body)
    err = as_request_error(info.value)
    assert (err.status, err.param) == (400, param)
    assert param in err.message


def test_invalid_json_is_named_as_such():
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate_json(b'{"messages": [')
    message, param = validation_message(info.value.errors())
    assert "not valid JSON" in message and param is None


def test_error_body_has_the_openai_shape():
    body = error_body("the model 'x' does not exist", 404, "model", "model_not_found")
    assert body == {"error": {"message": "the model 'x' does not exist", "type": "invalid_request_error",
                              "param": "model", "code": "model_not_found"}}
    assert error_body("boom", 503)["error"]["type"] == "service_unavailable"


def test_internal_errors_map_to_500_and_request_errors_keep_their_status():
    assert as_request_error(RuntimeError("bug")).status == 500
    assert as_request_error(RequestError("gone", 503)).status == 503


def test_sampling_params_cross_the_wire_and_are_validated_again():
    params = completion(n=2, seed=5, stop=["\n"], logit_bias={"7": 1.5}, logprobs=2)
    wire = msgspec.msgpack.encode(AddRequest("r-0", [1, 2, 3], params, "salt"))
    back = msgspec.msgpack.Decoder(ToScheduler).decode(wire)
    assert isinstance(back, AddRequest) and back.params == params and back.params.stop_strings == ["\n"]
    bad = msgspec.msgpack.encode({"type": "AddRequest", "request_id": "r", "prompt_token_ids": [1],
                                  "params": {"top_p": 7.0}})
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.msgpack.Decoder(ToScheduler).decode(bad)


def test_an_undecodable_request_is_reported_with_its_id_not_dropped(tmp_path):
    # A value the API's validation let through (a bool where a token id goes) must fail its request
    # in the scheduler: dropped, the client waited forever.
    import time

    import zmq

    from tokenmill.engine.scheduler_process import SchedulerLoop
    from tokenmill.ipc.channels import IpcPaths, Receiver, Sender, Undecodable
    from tokenmill.ipc.messages import RequestFailed

    paths, ctx = IpcPaths(str(tmp_path)), zmq.Context()
    try:
        inboxes = [Receiver(ctx, paths.address(name), ToScheduler, report_undecodable=report)
                   for name, report in (("reporting", True), ("dropping", False))]
        senders = [Sender(ctx, paths.address(name)) for name in ("reporting", "dropping")]  # alive till the end:
        for out in senders:  # LINGER 0 drops what a closed socket has not sent yet
            out.send(AddRequest("r-7", [True, False], completion()))  # msgspec encodes the bools as bools
            out.sock.send(b"\xc1")  # not even msgpack (0xc1 is never used)
            out.send(AddRequest("r-8", [1, 2], completion()))
        got = [[] for _ in inboxes]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(len(g) >= n for g, n in zip(got, (3, 1))):
            for inbox, g in zip(inboxes, got):
                inbox.poll(50)
                g.extend(inbox.drain())
        reported, dropped = got
        assert [type(m) for m in dropped] == [AddRequest] and dropped[0].request_id == "r-8"
        assert [type(m) for m in reported] == [Undecodable, Undecodable, AddRequest]
        first, garbage = reported[0], reported[1]
        assert (first.tag, first.request_id) == ("AddRequest", "r-7") and "prompt_token_ids" in first.error
        assert (garbage.tag, garbage.request_id) == (None, None)

        class Main:
            sent: list = []

            def send(self, message):
                self.sent.append(message)

        loop = SchedulerLoop.__new__(SchedulerLoop)  # only handle() and its channel to main
        loop.to_main, loop._stats_dirty = Main(), False
        loop.handle(first)
        loop.handle(garbage)  # nothing to answer: no request id
        [failed] = Main.sent
        assert isinstance(failed, RequestFailed) and (failed.request_id, failed.status) == ("r-7", 400)
        assert "Expected `int`, got `bool`" in failed.message
    finally:
        ctx.destroy(linger=0)
