"""Tool calls over HTTP with the official SDK: the real app on a fake manager that streams a crafted
reply one token per delta (the bundled model does not write calls), so markers arrive cut."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI

from tests.server.fake_server import bundled_tokenizer, client_of, sdk_client
from tests.server.test_reasoning_server import TokenByTokenManager, stream_events
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.reasoning_parser import get_reasoning_parser
from tokenmill.frontend.tool_parsers import get_tool_parser

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}
TIME = {"name": "get_time", "arguments": {"tz": "CET"}}
REPLY = f"Let me check.\n<tool_call>\n{json.dumps(WEATHER)}\n</tool_call>\n<tool_call>\n{json.dumps(TIME)}\n</tool_call>"
TOOLS = [
    {"type": "function", "function": {"name": c["name"], "parameters": {"type": "object"}}} for c in (WEATHER, TIME)
]
CHAT = {"messages": [{"role": "user", "content": "Weather and time in Paris?"}], "tools": TOOLS}


def app_with(tool_parser: str | None, reply: str = REPLY, reasoning_parser: str | None = None) -> FastAPI:
    manager = TokenByTokenManager(bundled_tokenizer(), reply)
    state = ServerState()
    state.attach(manager, ServerMetrics(lambda: None),  # type: ignore[arg-type]
                 get_reasoning_parser(reasoning_parser) if reasoning_parser else None,
                 get_tool_parser(tool_parser) if tool_parser else None)
    return build_app(ServerConfig(), state=state)


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def test_non_streaming_message_has_tool_calls():
    with client_of(app_with("hermes")) as http:
        resp = sdk_client(http).chat.completions.create(model="fake-model", **CHAT)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert calls_of(choice.message.tool_calls) == EXPECTED
    ids = [c.id for c in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert all(c.type == "function" for c in choice.message.tool_calls)


def test_calls_alone_have_null_content():
    reply = f"<tool_call>{json.dumps(WEATHER)}</tool_call>"
    with client_of(app_with("hermes", reply)) as http:
        body = http.post("/v1/chat/completions", json=CHAT).json()
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_streaming_deltas_as_openai_sends_them():
    events = stream_events(app_with("hermes"), {**CHAT, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events]
    content = [d["content"] for d in deltas if d.get("content")]
    assert "".join(content) == "Let me check." and len(content) > 1  # streamed, not gathered
    assert not any("<" in piece or "tool" in piece for piece in content)
    tool_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    for index, (name, args) in enumerate(EXPECTED):
        head, *fragments = [t for t in tool_deltas if t["index"] == index]
        assert head["id"].startswith("call_") and head["type"] == "function"
        assert head["function"] == {"name": name, "arguments": ""}
        assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
        assert json.loads("".join(f["function"]["arguments"] for f in fragments)) == args
    finishes = [e["choices"][0]["finish_reason"] for e in events]
    assert finishes[-1] == "tool_calls" and finishes[:-1] == [None] * (len(events) - 1)


def test_streaming_through_the_sdk_accumulates_the_calls():
    with client_of(app_with("hermes")) as http:
        stream = sdk_client(http).chat.completions.create(model="fake-model", stream=True, **CHAT)
        names: dict[int, str] = {}
        args: dict[int, str] = {}
        finish = None
        for chunk in stream:
            choice = chunk.choices[0]
            for call in choice.delta.tool_calls or ():
                if call.function.name:
                    names[call.index] = call.function.name
                args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
            finish = choice.finish_reason or finish
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == EXPECTED
    assert finish == "tool_calls"


def test_with_reasoning_the_calls_come_from_the_answer():
    reply = f"<think>Two tools.</think>{REPLY}"
    with client_of(app_with("hermes", reply, reasoning_parser="qwen3")) as http:
        body = http.post("/v1/chat/completions", json=CHAT).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Two tools." and message["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == EXPECTED


def test_malformed_call_stays_content():
    reply = '<tool_call>{"name": "get_weather", "arguments": {</tool_call>'
    with client_of(app_with("hermes", reply)) as http:
        body = http.post("/v1/chat/completions", json=CHAT).json()
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": reply} and choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("parser", "extra"),
    [(None, {}), ("hermes", {"tool_choice": "none"}), ("hermes", {"tools": None})],
)
def test_without_parser_or_with_tool_choice_none_nothing_changes(parser, extra):
    app = app_with(parser)
    with client_of(app) as http:
        body = http.post("/v1/chat/completions", json={**CHAT, **extra}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    events = stream_events(app, {**CHAT, **extra, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content", "") for d in deltas) == REPLY
    assert not any("tool_calls" in d for d in deltas) and events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, ("get_stock", "get_weather")),
        ({"tool_choice": "auto", "tools": None}, ("tools",)),
        ({"tool_choice": "required", "tools": []}, ("tools",)),
        ({"tool_choice": "sometimes"}, ("sometimes",)),
        ({"tool_choice": {"type": "function"}}, ("function",)),
    ],
)
def test_bad_tool_choice_is_400_naming_it(extra, words):
    with client_of(app_with("hermes")) as http:
        resp = http.post("/v1/chat/completions", json={**CHAT, **extra})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "tool_choice" and error["type"] == "invalid_request_error"
    assert all(word in error["message"] for word in words), error["message"]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("choice", "reply"),
    [(NAMED, json.dumps(WEATHER["arguments"])), ("required", json.dumps([
        {"name": c["name"], "parameters": c["arguments"]} for c in (WEATHER, TIME)]))],
)
def test_forced_calls_are_read_whatever_the_parser(choice, reply):
    expected = EXPECTED[:1] if choice is NAMED else EXPECTED
    app = app_with(None, reply)  # the grammar made the output the call: no --tool-call-parser needed
    with client_of(app) as http:
        resp = sdk_client(http).chat.completions.create(model="fake-model", tool_choice=choice, **CHAT)
    assert calls_of(resp.choices[0].message.tool_calls) == expected
    assert resp.choices[0].message.content is None and resp.choices[0].finish_reason == "tool_calls"
    events = stream_events(app, {**CHAT, "tool_choice": choice, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events]
    assert not any(d.get("content") for d in deltas)
    heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(i, e[0]) for i, e in enumerate(expected)]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_forced_output_cut_short_is_never_content():
    reply = '{"city": "Par'
    with client_of(app_with(None, reply)) as http:
        body = http.post("/v1/chat/completions", json={**CHAT, "tool_choice": NAMED}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None}


def test_forced_call_with_another_constraint_is_400():
    with client_of(app_with("hermes")) as http:
        resp = http.post("/v1/chat/completions",
                         json={**CHAT, "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
