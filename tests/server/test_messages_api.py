"""POST /v1/messages and /v1/messages/count_tokens through the official `anthropic` SDK, on the real
app and a fake manager that streams a crafted reply one token per delta: blocks, stop reasons, the
streaming events, x-api-key, errors in Anthropic's shape. (The real model: test_agent_apis_real.py.)"""

from __future__ import annotations

import json

import anthropic
import pytest
from fastapi import FastAPI

from tests.server.fake_server import bundled_tokenizer, client_of
from tests.server.test_responses_api import RecordingManager
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.reasoning_parser import get_reasoning_parser
from tokenmill.frontend.request_error import RequestError
from tokenmill.ipc.messages import TextOutput

TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def app_with(reply: str, reasoning: str | None = None, finish: str = "stop",
             api_key: str | None = None) -> tuple[FastAPI, RecordingManager]:
    manager = RecordingManager(bundled_tokenizer(), reply)
    manager.finish = finish
    state = ServerState()
    state.attach(manager, ServerMetrics(lambda: None),  # type: ignore[arg-type]
                 get_reasoning_parser(reasoning) if reasoning else None)
    return build_app(ServerConfig(api_key=api_key), state=state), manager


def sdk(http, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(http.base_url), api_key=key, http_client=http, max_retries=0)


def test_text_reply():
    app, manager = app_with("Sunny.")
    with client_of(app) as http:
        msg = sdk(http).messages.create(model="fake-model", max_tokens=20, messages=USER,
                                        system=[{"type": "text", "text": "You are terse."}])
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Sunny."
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens == len(manager.reply_ids)
    assert msg.usage.input_tokens > 0 and msg.id.startswith("msg_")
    assert "You are terse." in manager.prompts[0]


def test_stream_events_and_thinking():
    app, _ = app_with("<think>Look it up.</think>Sunny.", reasoning="qwen3")
    with client_of(app) as http, http.stream("POST", "/v1/messages", json={
            "model": "fake-model", "max_tokens": 20, "messages": USER, "stream": True}) as resp:
        names = [line[len("event: "):] for line in resp.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == 2 and names.count("content_block_stop") == 2
    with client_of(app) as http, sdk(http).messages.stream(model="fake-model", max_tokens=20, messages=USER) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Look it up." and final.content[1].text == "Sunny."


def test_forced_tool_use_and_a_tool_round_trip():
    app, manager = app_with('{"city": "Paris"}')
    with client_of(app) as http:
        client = sdk(http)
        msg = client.messages.create(model="fake-model", max_tokens=30, messages=USER, tools=TOOLS,
                                     tool_choice={"type": "tool", "name": "get_weather"})
        (use,) = msg.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
        assert msg.stop_reason == "tool_use"
        with client.messages.stream(model="fake-model", max_tokens=30, messages=USER, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"}) as stream:
            streamed = stream.get_final_message()
        assert streamed.content[0].input == {"city": "Paris"} and streamed.stop_reason == "tool_use"
        turns = [*USER, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": "18 degrees"}]}]}]
        client.messages.create(model="fake-model", max_tokens=30, messages=turns, tools=TOOLS)
    assert "18 degrees" in manager.prompts[-1] and "Paris" in manager.prompts[-1]


def test_stop_reasons():
    app, _ = app_with("Long answer", finish="length")
    with client_of(app) as http:
        assert sdk(http).messages.create(model="fake-model", max_tokens=3, messages=USER).stop_reason == "max_tokens"
    calls = json.dumps([{"name": "get_weather", "parameters": {"city": "a"}}])
    app, _ = app_with(calls)
    with client_of(app) as http:
        msg = sdk(http).messages.create(model="fake-model", max_tokens=30, messages=USER, tools=TOOLS,
                                        tool_choice={"type": "any"})
    assert msg.stop_reason == "tool_use" and msg.content[0].input == {"city": "a"}


def test_count_tokens_matches_the_prompt():
    app, manager = app_with("Sunny.")
    with client_of(app) as http:
        client = sdk(http)
        count = client.messages.count_tokens(model="fake-model", messages=USER, system="Be terse.")
        msg = client.messages.create(model="fake-model", max_tokens=5, messages=USER, system="Be terse.")
    assert count.input_tokens == msg.usage.input_tokens


def test_api_key_as_x_api_key_or_bearer():
    app, _ = app_with("Hi", api_key="sekret")
    with client_of(app) as http:
        assert sdk(http, "sekret").messages.create(model="fake-model", max_tokens=5, messages=USER).content
        resp = http.post("/v1/messages", json={"max_tokens": 5, "messages": USER},
                         headers={"Authorization": "Bearer sekret"})
        assert resp.status_code == 200
        with pytest.raises(anthropic.AuthenticationError) as info:
            sdk(http, "wrong").messages.create(model="fake-model", max_tokens=5, messages=USER)
    assert info.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice 'any' needs a non-empty tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": []}]}, "messages[0].content is empty"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
     "tools[0].input_schema must be a JSON schema of type 'object'"),
    ({"max_tokens": 5, "messages": USER, "stop_sequences": [""]}, "stop_sequences must be"),
    ({"max_tokens": 5, "messages": USER, "model": "claude-nope"}, "claude-nope"),
])
def test_errors_in_anthropics_shape(body, words):
    app, _ = app_with("Hi")
    with client_of(app) as http:
        resp = http.post("/v1/messages", json=body)
    assert resp.status_code in (400, 404), resp.text
    error = resp.json()
    assert error["type"] == "error" and error["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert words in error["error"]["message"]


def test_a_failure_mid_stream_ends_with_an_error_event():
    app, manager = app_with("Hi")
    manager.fail_with = RequestError("the server is shutting down", 503)
    with client_of(app) as http, http.stream("POST", "/v1/messages", json={
            "max_tokens": 5, "messages": USER, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith(("event: ", "data: "))]
    assert [line for line in lines if line.startswith("event: ")] == ["event: message_start", "event: ping",
                                                                     "event: error"]
    assert json.loads(lines[-1][len("data: "):]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "the server is shutting down"}}


def test_streamed_usage_ends_as_the_messages_usage_with_the_cached_prompt():
    # message_start goes out before the first output says how much of the prompt the cache served:
    # the final message_delta carries the whole usage, so a stream's final message counts as create's.
    class CachedPrefix(RecordingManager):
        async def generate(self, request_id, seqs, **kw):
            first = True
            async for i, out in super().generate(request_id, seqs, **kw):
                if first:
                    out = TextOutput(out.request_id, out.text, out.token_ids, out.finished, out.finish_reason,
                                     out.stop_reason, out.num_output_tokens, num_cached_tokens=5)
                    first = False
                yield i, out

    app, manager = app_with("Sunny.")
    manager.__class__ = CachedPrefix  # the attached manager, now answering from a cached prefix
    with client_of(app) as http:
        client = sdk(http)
        made = client.messages.create(model="fake-model", max_tokens=20, messages=USER).usage
        with client.messages.stream(model="fake-model", max_tokens=20, messages=USER) as stream:
            streamed = stream.get_final_message().usage
    assert made.cache_read_input_tokens == 5 and made.input_tokens > 0
    assert (streamed.input_tokens, streamed.cache_read_input_tokens, streamed.output_tokens) == (
        made.input_tokens, made.cache_read_input_tokens, made.output_tokens)
