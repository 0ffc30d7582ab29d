"""POST /v1/responses through the official `openai` SDK, on the real app and a fake manager that
streams a crafted reply one token per delta: items, semantic events in order, the store per API key,
errors naming the field. (The real model and the Agents SDK: test_agent_apis_real.py.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

import openai
import pydantic
import pytest
from fastapi import FastAPI

from tests.server.fake_server import bundled_tokenizer, client_of, sdk_client
from tests.server.test_reasoning_server import TokenByTokenManager
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.reasoning_parser import get_reasoning_parser
from tokenmill.frontend.request_error import RequestError
from tokenmill.frontend.sequences import Seq
from tokenmill.ipc.messages import TextOutput

TOOLS = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("get_weather", "get_time")]
CALLS = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}])


class RecordingManager(TokenByTokenManager):
    """Remembers each prompt, ends with `finish` ("length": a cut reply), or fails with `fail_with`."""

    finish = "stop"

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.prompts: list[str] = []

    async def generate(self, request_id: str, seqs: Sequence[Seq], **kw: object) -> AsyncIterator[tuple[int, TextOutput]]:
        self.prompts.append(self.tokenizer.decode(seqs[0].prompt_token_ids, skip_special_tokens=False))
        if self.fail_with is not None:  # as a request ended by the server (drain, a dead child) ends
            raise self.fail_with
        async for i, out in super().generate(request_id, seqs, **kw):
            if out.finished and self.finish != "stop":
                out = TextOutput(out.request_id, out.text, out.token_ids, True, self.finish, None,
                                 out.num_output_tokens)
            yield i, out


def app_with(reply: str, reasoning: str | None = None, finish: str = "stop") -> tuple[FastAPI, RecordingManager]:
    manager = RecordingManager(bundled_tokenizer(), reply)
    manager.finish = finish
    state = ServerState()
    state.attach(manager, ServerMetrics(lambda: None),  # type: ignore[arg-type]
                 get_reasoning_parser(reasoning) if reasoning else None)
    return build_app(ServerConfig(), state=state), manager


def test_text_reply_and_usage():
    app, manager = app_with("Hello there!")
    with client_of(app) as http:
        resp = sdk_client(http).responses.create(model="fake-model", input="Hi", instructions="Be brief.")
    assert resp.status == "completed" and resp.output_text == "Hello there!"
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert resp.usage.output_tokens == len(manager.reply_ids) and resp.usage.input_tokens > 0
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    assert "Be brief." in manager.prompts[0] and "Hi" in manager.prompts[0]


def test_stream_events_in_their_documented_order():
    app, _ = app_with("Hello there!")
    with client_of(app) as http, sdk_client(http).responses.stream(model="fake-model", input="Hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [k for k in kinds if k == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *deltas, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]
    assert len(deltas) > 1  # streamed, not gathered
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "Hello there!" and final.id == events[0].response.id


def test_reasoning_item_and_reasoning_tokens():
    app, _ = app_with("<think>Easy.</think>Four.", reasoning="qwen3")
    with client_of(app) as http:
        resp = sdk_client(http).responses.create(model="fake-model", input="2+2?")
        with sdk_client(http).responses.stream(model="fake-model", input="2+2?") as stream:
            kinds = [e.type for e in stream]
    assert [i.type for i in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Easy." and resp.output_text == "Four."
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    assert "response.reasoning_text.delta" in kinds


def test_forced_calls_and_a_round_trip_through_the_store():
    app, manager = app_with(CALLS)
    with client_of(app) as http:
        client = sdk_client(http)
        first = client.responses.create(model="fake-model", input="Weather and time?", tools=TOOLS,
                                        tool_choice="required")
        calls = [i for i in first.output if i.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                      ("get_time", {})]
        assert first.output_text == "" and all(c.call_id.startswith("call_") for c in calls)
        results = [{"type": "function_call_output", "call_id": c.call_id, "output": f"result of {c.name}"}
                   for c in calls]
        client.responses.create(model="fake-model", input=results, previous_response_id=first.id, tools=TOOLS)
    prompt = manager.prompts[1]
    assert "Weather and time?" in prompt and "result of get_weather" in prompt and "result of get_time" in prompt


def test_stream_of_forced_calls():
    app, _ = app_with(CALLS)
    with client_of(app) as http, sdk_client(http).responses.stream(
            model="fake-model", input="x", tools=TOOLS, tool_choice="required") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") == 2
    assert kinds.count("response.function_call_arguments.done") == 2 and "response.output_text.delta" not in kinds
    assert [i.name for i in final.output] == ["get_weather", "get_time"]


def test_a_length_cut_keeps_the_complete_calls_and_is_incomplete():
    app, _ = app_with(CALLS[:-20], finish="length")
    with client_of(app) as http:
        resp = sdk_client(http).responses.create(model="fake-model", input="x", tools=TOOLS, tool_choice="required",
                                                 max_output_tokens=30)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert [i.name for i in resp.output] == ["get_weather"] and resp.output_text == ""


def test_parse_with_a_json_schema_text_format():
    class Answer(pydantic.BaseModel):
        city: str

    app, _ = app_with('{"city": "Paris"}')
    with client_of(app) as http:
        resp = sdk_client(http).responses.parse(model="fake-model", input="Where?", text_format=Answer)
    assert resp.output_parsed == Answer(city="Paris")


def test_stored_responses_per_api_key():
    app, _ = app_with("Hi!")
    with client_of(app) as http:
        mine = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="alice", http_client=http, max_retries=0)
        theirs = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="bob", http_client=http, max_retries=0)
        resp = mine.responses.create(model="fake-model", input="Hello")
        assert mine.responses.retrieve(resp.id).output_text == "Hi!"
        (item,) = mine.responses.input_items.list(resp.id).data
        assert item.type == "message" and item.content[0].text == "Hello"
        for call in (lambda: theirs.responses.retrieve(resp.id), lambda: theirs.responses.delete(resp.id),
                     lambda: theirs.responses.create(model="fake-model", input="x", previous_response_id=resp.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        mine.responses.delete(resp.id)
        with pytest.raises(openai.NotFoundError):
            mine.responses.retrieve(resp.id)
        unstored = mine.responses.create(model="fake-model", input="Hello", store=False)
        with pytest.raises(openai.NotFoundError):
            mine.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": 5}, "input"),
])
def test_bad_requests_are_400_naming_the_field(body, param):
    app, _ = app_with("Hi")
    with client_of(app) as http:
        resp = http.post("/v1/responses", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_a_failure_mid_stream_ends_as_response_failed_then_error():
    app, manager = app_with("Hi")
    manager.fail_with = RequestError("the server is shutting down", 503, code="server_shutting_down")
    with client_of(app) as http, http.stream("POST", "/v1/responses", json={"input": "x", "stream": True}) as resp:
        events = [json.loads(line[len("data: "):]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed", "error"]
    assert events[2]["response"]["status"] == "failed"
    assert events[2]["response"]["error"] == {"code": "server_shutting_down", "message": "the server is shutting down"}
    with client_of(app) as http:
        assert http.post("/v1/responses", json={"input": "x"}).status_code == 503


@pytest.mark.parametrize(("body", "says"), [
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens must be"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
])
def test_a_bad_field_is_named_as_this_api_names_it(body, says):
    app, _ = app_with("Hi")
    with client_of(app) as http:
        message = http.post("/v1/responses", json=body).json()["error"]["message"]
    assert message.startswith(says) and "max_tokens" not in message and "response_format" not in message, message
