"""The readers that stream arguments (Qwen3-Coder's XML, pythonic lists) on crafted outputs, fed whole
and a few characters at a time: the same calls and content either way, and the argument fragments
joined are each call's arguments."""

from __future__ import annotations

import json

import pytest

from tokenmill.frontend.tool_call import ToolCall
from tokenmill.frontend.tool_parser_pythonic import read_call
from tokenmill.frontend.tool_parsers import get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}]


def run(parser: str, text: str, step: int | None = None) -> tuple[str, list[ToolCall], dict[str, list[str]]]:
    state = get_tool_parser(parser).new_state(TOOLS)
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    deltas = [state.feed(piece) for piece in pieces] + [state.finish()]
    fragments: dict[str, list[str]] = {}
    for d in deltas:
        for f in d.fragments:
            fragments.setdefault(f.id, []).append(f.arguments)
    calls = [c for d in deltas for c in d.calls]
    assert state.num_calls == len(calls)
    return "".join(d.content for d in deltas), calls, fragments


def xml(name: str, **params: object) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("step", [None, 1, 3, 7])
def test_qwen3_coder_calls_stream_their_parameters(step):
    text = f"Checking.\n{xml('get_weather', city='Paris', days=3, zip='75001')}\n{xml('get_time', tz='CET')}"
    content, calls, fragments = run("qwen3_coder", text, step)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "zip": "75001"}),  # zip stays a string: the schema says so
        ("get_time", {"tz": "CET"})]
    for call in calls:
        assert "".join(fragments[call.id]) == call.arguments
    assert len(fragments[calls[0].id]) == 5  # announced, three parameters, the closing brace


@pytest.mark.parametrize("step", [None, 1, 4])
def test_qwen3_coder_without_closing_tags_and_text_after(step):
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</function>\n</tool_call>\n\nDone."
    content, calls, _ = run("qwen3_coder", text, step)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Lyon"})]
    assert content == "Done."


@pytest.mark.parametrize("step", [None, 1])
def test_qwen3_coder_markup_without_a_function_stays_text(step):
    text = "Use <tool_call> tags like this."
    content, calls, _ = run("qwen3_coder", text, step)
    assert calls == [] and content == text


def test_qwen3_coder_call_cut_mid_parameter_is_not_completed():
    content, calls, fragments = run("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", 2)
    assert calls == [] and content == "" and list(fragments.values()) == [[""]]  # announced, never finished


@pytest.mark.parametrize("step", [None, 1, 5])
def test_pythonic_list_of_calls(step):
    text = '[get_weather(city="Paris", days=3), get_time(tz=\'CET\', dst=True, extra={"a": [1, 2]})]'
    content, calls, _ = run("pythonic", text, step)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET", "dst": True, "extra": {"a": [1, 2]}})]


def test_pythonic_calls_arrive_as_each_element_closes():
    state = get_tool_parser("pythonic").new_state()
    assert state.feed('[get_weather(city="a, b)")').calls == ()  # a comma inside a string does not split
    first = state.feed(", get_time(")
    assert [c.name for c in first.calls] == ["get_weather"] and json.loads(first.calls[0].arguments) == {"city": "a, b)"}
    assert [c.name for c in state.feed(")]").calls] == ["get_time"]


@pytest.mark.parametrize("text", ["[1] First point.", "Sure: [get_weather(city='x')]", "[not a call", "plain"])
def test_pythonic_text_that_is_no_list_of_calls_stays_content(text):
    for step in (None, 1):
        content, calls, _ = run("pythonic", text, step)
        assert calls == [] and content == text


def test_pythonic_element_cut_after_complete_calls_is_dropped():
    content, calls, _ = run("pythonic", '[get_time(tz="CET"), get_weather(city="Pa', 3)
    assert [c.name for c in calls] == ["get_time"] and content == ""


def test_read_call_refuses_what_is_no_keyword_call():
    assert read_call("f(1)") is None and read_call("x + 1") is None and read_call("f(**kw)") is None
    assert read_call("mod.f(a=None)").name == "mod.f"
