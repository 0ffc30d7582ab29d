"""Ollama request bodies -> the OpenAI request fields the chat path takes (entrypoints/ollama/options.py):
every mapped option, the ones ignored, and a 400 naming the option for a wrong type."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.ollama.options import (
    chat_messages,
    check_generate_fields,
    response_format,
    sampling_fields,
    tool_choice,
)
from tokenmill.entrypoints.openai.params import chat_sampling_params
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.errors import InvalidRequest


def test_options_map_onto_sampling_params():
    options = {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7, "num_predict": 33,
               "stop": ["\n\n"], "repeat_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3,
               "num_ctx": 131072, "num_gpu": 99, "mirostat": 2}  # the last three: accepted, ignored
    req = ChatCompletionRequest.model_validate({"messages": [], **sampling_fields(options)})
    p = chat_sampling_params(req)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (0.5, 0.9, 40, 0.05, 7, 33)
    assert p.stop == ["\n\n"] and p.repetition_penalty == 1.1
    assert (p.presence_penalty, p.frequency_penalty) == (0.2, 0.3)
    # -1 (until done) and -2 (fill the context) are no limit; top_k 0 is no top-k
    assert sampling_fields({"num_predict": -1, "top_k": 0}) == {}
    assert sampling_fields({"stop": "END"}) == {"stop": ["END"]}


@pytest.mark.parametrize(("options", "param"), [
    ({"temperature": "hot"}, "options.temperature"),
    ({"top_k": 1.5}, "options.top_k"),
    ({"seed": True}, "options.seed"),
    ({"num_predict": -3}, "options.num_predict"),
    ({"stop": [1]}, "options.stop"),
    ({"tool_choice": 3}, "options.tool_choice"),
])
def test_bad_option_names_itself(options, param):
    with pytest.raises(InvalidRequest) as err:
        sampling_fields(options)
        tool_choice(options)
    assert err.value.param == param


def test_format_and_tool_choice():
    assert response_format("json") == {"type": "json_object"}
    schema = {"type": "object"}
    assert response_format(schema)["json_schema"]["schema"] == schema
    assert response_format("") is None
    with pytest.raises(InvalidRequest):
        response_format("yaml")
    assert tool_choice({"tool_choice": "get_weather"}) == {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice({"tool_choice": "required"}) == "required" and tool_choice(None) is None


def test_messages_with_tool_calls_and_results():
    out = chat_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {"c": "P"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "w"},
    ])
    assert out[1]["tool_calls"][0]["type"] == "function" and out[1]["tool_calls"][0]["function"]["arguments"] == {"c": "P"}
    assert out[2]["tool_call_id"] == "w"
    with pytest.raises(InvalidRequest):
        chat_messages([{"role": "user", "content": "x", "images": ["abc"]}])


def test_generate_fields_this_server_cannot_honour_are_refused_not_ignored():
    check_generate_fields({"prompt": "hi", "suffix": "", "template": None})  # empty: as if not sent
    for field, value, says in (("suffix", "return x", "does not support insert"),
                               ("template", "{{ .Prompt }}", "raw: true")):
        with pytest.raises(InvalidRequest, match=says) as info:
            check_generate_fields({"prompt": "def f(", field: value})
        assert info.value.param == field

