"""Tool-call parsers on crafted model outputs, fed whole and one character at a time."""

from __future__ import annotations

import json

import pytest

from tokenmill.frontend.tool_parsers import TOOL_PARSERS, ToolCall, get_tool_parser, parse_calls

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}


def run(parser: str, text: str, step: int | None = None) -> tuple[str, list[ToolCall], list[str]]:
    """Content, calls and the content deltas; `step`: feed that many characters at a time."""
    state = get_tool_parser(parser).new_state()
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    deltas = [state.feed(piece) for piece in pieces] + [state.finish()]
    assert state.num_calls == sum(len(d.calls) for d in deltas)
    contents = [d.content for d in deltas if d.content]
    return "".join(contents), [c for d in deltas for c in d.calls], contents


def hermes(call: dict) -> str:
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def assert_calls(calls: list[ToolCall], expected: list[dict]) -> None:
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(e["name"], e["arguments"]) for e in expected]
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in calls)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("step", [None, 1, 2, 5])
def test_hermes_several_calls_with_text_before(step):
    text = f"Let me look both up.\n{hermes(WEATHER)}\n{hermes(TIME)}"
    content, calls, contents = run("hermes", text, step)
    assert content == "Let me look both up."
    assert_calls(calls, [WEATHER, TIME])
    assert not any("<" in piece for piece in contents)


@pytest.mark.parametrize("step", [None, 1, 3])
def test_hermes_text_after_a_call_and_calls_alone(step):
    content, calls, _ = run("hermes", f"{hermes(WEATHER)}\n\nI asked for the weather.", step)
    assert content == "I asked for the weather."
    assert_calls(calls, [WEATHER])
    content, calls, _ = run("hermes", f"First.\n{hermes(WEATHER)}\nThen.\n{hermes(TIME)}\n", step)
    assert content == "First.\nThen."  # words on either side of a call stay apart
    assert_calls(calls, [WEATHER, TIME])
    content, calls, _ = run("hermes", f"  {hermes(WEATHER)}{hermes(TIME)}\n", step)
    assert content == ""
    assert_calls(calls, [WEATHER, TIME])


@pytest.mark.parametrize("step", [None, 1])
def test_hermes_malformed_json_stays_text(step):
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    content, calls, _ = run("hermes", f"Before {bad} after", step)
    assert content == f"Before {bad} after" and calls == []
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    content, calls, _ = run("hermes", f"{no_name}{hermes(TIME)}", step)
    assert content == no_name
    assert_calls(calls, [TIME])


@pytest.mark.parametrize("step", [None, 1])
def test_hermes_cut_marker_at_the_end_is_text_and_unclosed_call_is_read(step):
    content, calls, _ = run("hermes", "The tag is <tool_ca", step)
    assert content == "The tag is <tool_ca" and calls == []
    content, calls, _ = run("hermes", f"<tool_call>{json.dumps(WEATHER)}", step)  # stopped before the end tag
    assert content == "" and len(calls) == 1
    content, calls, _ = run("hermes", '<tool_call>{"name": "x", "argu', step)
    assert content == '<tool_call>{"name": "x", "argu' and calls == []


def test_hermes_plain_reply_is_unchanged_and_streams():
    text = "Hello there, how are you < today? "
    content, calls, contents = run("hermes", text, 1)
    assert content == text and calls == []
    assert len(contents) > 10


def test_arguments_given_as_a_json_string_or_parameters():
    (call,) = parse_calls('{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert call.arguments == '{"a": 1}'
    (call,) = parse_calls('{"name": "f", "parameters": {"a": "é"}}')
    assert call.arguments == '{"a": "é"}'
    (call,) = parse_calls('{"name": "f"}')
    assert call.arguments == "{}"
    assert parse_calls('{"name": "f", "arguments": [1]}') is None
    assert parse_calls("") is None


@pytest.mark.parametrize("step", [None, 1, 4])
@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", " \n"])
def test_llama3_json_whole_reply(step, prefix):
    llama = [{"name": c["name"], "parameters": c["arguments"]} for c in (WEATHER, TIME)]
    content, calls, _ = run("llama3_json", prefix + "; ".join(json.dumps(c) for c in llama), step)
    assert content == ""
    assert_calls(calls, [WEATHER, TIME])


@pytest.mark.parametrize("step", [None, 1])
def test_llama3_json_not_a_call_is_text(step):
    for text in ('{"answer": 4}', '{"name": "f", "parameters": {', "The answer is {4}.", "Plain text."):
        content, calls, _ = run("llama3_json", text, step)
        assert content == text and calls == []


@pytest.mark.parametrize("step", [None, 1, 3])
def test_mistral_calls_after_text_and_bare(step):
    array = json.dumps([WEATHER, TIME])
    content, calls, contents = run("mistral", f"Checking.[TOOL_CALLS]{array}", step)
    assert content == "Checking."
    assert not any("[" in piece for piece in contents)
    assert_calls(calls, [WEATHER, TIME])
    content, calls, _ = run("mistral", array, step)  # the control token already dropped by the detokenizer
    assert content == ""
    assert_calls(calls, [WEATHER, TIME])
    content, calls, _ = run("mistral", "[TOOL_CALLS][{bad json", step)
    assert content == "[TOOL_CALLS][{bad json" and calls == []


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'; known: glm45, hermes, llama3_json, mistral"):
        get_tool_parser("qwen")
    assert set(TOOL_PARSERS) == {"glm45", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"}
