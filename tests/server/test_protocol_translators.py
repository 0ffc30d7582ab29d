"""The Responses and Messages translators without a server: request bodies to chat's shape, and the
choice events to output items / content blocks (the same builder serves both streaming modes)."""

from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.anthropic.output import MessageBuilder, stop_reason
from tokenmill.entrypoints.anthropic.protocol import MessagesRequest
from tokenmill.entrypoints.anthropic.translate import chat_request as anthropic_chat
from tokenmill.entrypoints.responses.input_items import chat_request as responses_chat
from tokenmill.entrypoints.responses.input_items import input_messages
from tokenmill.entrypoints.responses.output import ResponseBuilder
from tokenmill.entrypoints.responses.protocol import ResponsesRequest
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.choice_events import CallArguments, CallDone, CallStarted, Finished, Reasoning, Text
from tokenmill.frontend.tool_call import ToolCall

CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')


def test_responses_items_become_chat_messages():
    messages = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
    ])
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1] == {"role": "user", "content": "Weather ?"}
    assistant = messages[2]
    assert assistant["content"] == "Checking." and [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "18 C"} and len(messages) == 4


def test_responses_request_fields_map_to_chat():
    req = ResponsesRequest.model_validate({
        "input": "Hi", "instructions": "Sys", "max_output_tokens": 7, "temperature": 0, "parallel_tool_calls": False,
        "priority": -3, "seed": 5,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})
    chat = responses_chat(req, history=[{"role": "user", "content": "Earlier"}])
    assert [m["content"] for m in chat.messages] == ["Sys", "Earlier", "Hi"]
    assert chat.max_tokens == 7 and chat.parallel_tool_calls is False
    assert chat.priority == -3 and chat.seed == 5
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


def test_response_builder_orders_items_and_drops_a_cut_call():
    builder = ResponseBuilder()
    sent = builder.feed([Reasoning("hm"), Text("Hi"), CallStarted(0, "call_1", "get_weather"),
                         CallArguments(0, CALL.arguments), CallDone(0, CALL), CallStarted(1, "call_2", "get_time"),
                         CallArguments(1, '{"tz": "C'), Finished("length", None)])
    assert [i["type"] for i in builder.output] == ["reasoning", "message", "function_call"]
    assert builder.output[2]["call_id"] == "call_1" and builder.output[2]["status"] == "completed"
    done = [e["item"] for e in sent if e["type"] == "response.output_item.done"]
    assert done[-1]["call_id"] == "call_2" and done[-1]["status"] == "incomplete"  # closed in the stream
    added = [e["output_index"] for e in sent if e["type"] == "response.output_item.added"]
    assert added == [0, 1, 2, 3]


def test_anthropic_blocks_become_chat_messages():
    req = MessagesRequest.model_validate({
        "max_tokens": 5, "system": [{"type": "text", "text": "Sys"}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""},
                                              {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18 C"},
                                         {"type": "text", "text": "And?"}]},
        ],
        "tools": [{"name": "w", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "stop_sequences": ["END"]})
    chat = anthropic_chat(req)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    call = chat.messages[2]["tool_calls"][0]
    assert chat.messages[2]["content"] is None and json.loads(call["function"]["arguments"]) == {"c": 1}
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "18 C"}
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False and chat.stop == ["END"]
    assert chat.tools[0]["function"]["parameters"] == {"type": "object"} and chat.max_tokens == 5


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}})])
def test_anthropic_tool_choice(choice, expected):
    req = MessagesRequest.model_validate({"max_tokens": 5, "messages": [], "tool_choice": choice,
                                          "tools": [{"name": "w", "input_schema": {"type": "object"}}]})
    assert anthropic_chat(req).tool_choice == expected


USE = {"type": "tool_use", "id": "t1", "name": "w", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "18 C"}
ASK = {"role": "user", "content": "Weather?"}


@pytest.mark.parametrize(("turns", "says"), [
    ([ASK, {"role": "assistant", "content": [USE]}, ASK], "messages[1]: tool_use ids were found without tool_result"),
    ([ASK, {"role": "assistant", "content": [{"type": "text", "text": "Let me"}, USE]}],  # a prefill with a call
     "messages[1]: tool_use ids were found without tool_result blocks immediately after: t1"),
    ([ASK, {"role": "assistant", "content": [USE]}, {"role": "assistant", "content": "So"}], "messages[1]: tool_use"),
    ([ASK, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": [RESULT]}],
     "messages[2].content[0]: unexpected tool_use_id found in tool_result blocks: t1"),
])
def test_anthropic_tool_use_and_tool_result_come_in_pairs(turns, says):
    with pytest.raises(InvalidRequest) as info:
        anthropic_chat(MessagesRequest.model_validate({"max_tokens": 5, "messages": turns}))
    assert says in info.value.message and info.value.param == "messages"


def test_anthropic_refusals_name_the_block():
    req = MessagesRequest.model_validate({"max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "document"}]}]})
    with pytest.raises(InvalidRequest) as info:
        anthropic_chat(req)
    assert "messages[0].content[1]" in info.value.message and info.value.param == "messages"


def test_message_builder_blocks_and_stop_reasons():
    builder = MessageBuilder()
    sent = builder.feed([Reasoning("hm"), Text("Hi"), CallStarted(0, "call_1", "get_weather"),
                         CallArguments(0, CALL.arguments), CallDone(0, CALL), Finished("tool_calls", None)])
    assert [b["type"] for b in builder.content] == ["thinking", "text", "tool_use"]
    assert builder.content[2]["input"] == {"city": "Paris"}
    deltas = [e[1]["delta"]["type"] for e in sent if e[0] == "content_block_delta"]
    assert deltas == ["thinking_delta", "text_delta", "input_json_delta"]
    assert [e[0] for e in sent].count("content_block_stop") == 3
    assert stop_reason(Finished("tool_calls", None)) == ("tool_use", None)
    assert stop_reason(Finished("length", None)) == ("max_tokens", None)
    assert stop_reason(Finished("stop", "END")) == ("stop_sequence", "END")
    assert stop_reason(Finished("stop", None)) == ("end_turn", None)
    assert stop_reason(Finished("stop", 42)) == ("end_turn", None)  # a stop token id is no stop sequence
