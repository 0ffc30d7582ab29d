"""tool_choice "required" and named functions -> the JSON schema the output is generated under."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.openai.params import chat_sampling_params, forced_call_schema
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import StructuredOutputParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: any object
]


def params(**body):
    return chat_sampling_params(ChatCompletionRequest.model_validate({"messages": [], "tools": TOOLS, **body}))


def test_named_function_generates_its_arguments():
    so = params(tool_choice={"type": "function", "function": {"name": "get_weather"}}).structured_output
    assert so is not None and so.json_schema == WEATHER and so.param == "tools"


def test_required_generates_an_array_of_calls_of_any_tool():
    so = params(tool_choice="required").structured_output
    assert so is not None
    schema = so.json_schema
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_other_choices_leave_the_output_free(choice):
    assert params(tool_choice=choice).structured_output is None
    assert forced_call_schema(choice, TOOLS) is None


def test_the_schemas_compile():
    xgrammar_backend = pytest.importorskip("tokenmill.sample.grammar").XGrammarBackend
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        schema = forced_call_schema(choice, TOOLS)
        assert xgrammar_backend.parse_spec(StructuredOutputParams(json_schema=schema)) is not None


def test_a_bad_tool_schema_is_a_400_naming_tools():
    backend = pytest.importorskip("tokenmill.sample.grammar").XGrammarBackend
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 5}}}]
    so = chat_sampling_params(ChatCompletionRequest.model_validate(
        {"messages": [], "tools": tools, "tool_choice": "required"})).structured_output
    with pytest.raises(InvalidRequest) as info:
        backend.parse_spec(so)
    assert info.value.param == "tools"


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}])
def test_a_tool_whose_arguments_are_not_an_object_is_a_400(schema):
    # A forced call under such a schema generated a bare value no tool call can carry: the reply came
    # back empty with finish_reason "stop".
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(InvalidRequest, match=r"tools\[0\]\.function\.parameters must be an object schema") as info:
        chat_sampling_params(ChatCompletionRequest.model_validate(
            {"messages": [], "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}))
    assert info.value.param == "tools"
