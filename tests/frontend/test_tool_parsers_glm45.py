"""The glm45 tool-call parser (GLM-4.5's `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>`)
on crafted outputs, fed whole and in small pieces so markers arrive cut across deltas."""

from __future__ import annotations

import json

import pytest

from tests.frontend.test_tool_parsers import run
from tokenmill.frontend.tool_parsers import read_glm45

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "zip": {"type": "string"}}}}}


def glm(name: str, args: dict[str, object]) -> str:
    """A call as GLM-4.5's chat template writes one: strings raw, other values as JSON."""
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
        for k, v in args.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("step", [None, 1, 2, 7])
def test_several_calls_with_text_typed_values(step):
    text = (f"I will check both.\n{glm('get_weather', {'city': 'Paris', 'days': 3, 'metric': True})}\n"
            f"{glm('get_time', {'tz': 'Europe/Paris', 'zones': ['CET', 'UTC'], 'opts': {'dst': None}})}")
    content, calls, contents = run("glm45", text, step)
    assert content == "I will check both."
    assert not any("<" in piece for piece in contents)  # no cut marker ever reached the content
    assert calls_of(calls) == [
        ("get_weather", {"city": "Paris", "days": 3, "metric": True}),
        ("get_time", {"tz": "Europe/Paris", "zones": ["CET", "UTC"], "opts": {"dst": None}}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("step", [None, 1, 3])
def test_text_after_a_call_and_a_call_without_arguments(step):
    content, calls, _ = run("glm45", f"{glm('get_time', {})}\n\nDone asking.", step)
    assert content == "Done asking."
    assert calls_of(calls) == [("get_time", {})]
    content, calls, _ = run("glm45", "<tool_call>get_time</tool_call>", step)  # GLM-4.7: no newline
    assert content == "" and calls_of(calls) == [("get_time", {})]


def test_values_typed_as_strings_by_the_schema_stay_strings():
    body = "get_weather\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n" \
           "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>city</arg_key>\n<arg_value>null</arg_value>"
    (call,) = read_glm45(body, [WEATHER_TOOL])
    assert json.loads(call.arguments) == {"zip": "75001", "days": 2, "city": "null"}
    (call,) = read_glm45(body, None)  # without the schema, JSON-looking values are JSON
    assert json.loads(call.arguments) == {"zip": 75001, "days": 2, "city": None}
    # A value that is not JSON is the text as written (trimmed, as vLLM does); a literal "\n" gap is allowed.
    (call,) = read_glm45("f\\n<arg_key>q</arg_key>\\n<arg_value> two words {x </arg_value>", None)
    assert json.loads(call.arguments) == {"q": "two words {x"}


def test_the_tools_reach_the_state_through_new_state():
    from tokenmill.frontend.tool_parsers import get_tool_parser

    state = get_tool_parser("glm45").new_state([WEATHER_TOOL])
    found = state.feed(glm("get_weather", {"zip": "01234"}))
    assert calls_of(found.calls) == [("get_weather", {"zip": "01234"})]


@pytest.mark.parametrize("step", [None, 1])
@pytest.mark.parametrize("bad", [
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</tool_call>",  # value never closed
    "<tool_call>get_weather\n<arg_key>city</arg_key>stray<arg_value>Paris</arg_value></tool_call>",
    "<tool_call>get_weather\nsome words\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
    "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # no name
    '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',  # hermes JSON is not this format
    "<tool_call>f\n<arg_key> </arg_key><arg_value>1</arg_value></tool_call>",  # empty key
])
def test_malformed_calls_stay_text(step, bad):
    content, calls, _ = run("glm45", f"Before {bad} after", step)
    assert content == f"Before {bad} after" and calls == []


@pytest.mark.parametrize("step", [None, 1])
def test_a_malformed_call_next_to_a_good_one(step):
    bad = "<tool_call>f\n<arg_key>a</arg_key></tool_call>"
    content, calls, _ = run("glm45", f"{bad}{glm('g', {'b': 2})}", step)
    assert content == bad and calls_of(calls) == [("g", {"b": 2})]


@pytest.mark.parametrize("step", [None, 1])
def test_cut_output(step):
    content, calls, _ = run("glm45", "Look: <tool_ca", step)  # a cut marker at the end is only text
    assert content == "Look: <tool_ca" and calls == []
    # Stopped before the end tag but after a whole pair: read as it is, like hermes.
    content, calls, _ = run("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n", step)
    assert content == "" and calls_of(calls) == [("f", {"a": 1})]
    cut = "<tool_call>f\n<arg_key>a</arg_key>\n<arg_val"  # cut inside a pair: not a call
    content, calls, _ = run("glm45", cut, step)
    assert content == cut and calls == []
