"""A full agent round trip through the official SDK on a real `tokenmill serve` with the bundled model:
a forced call, the tool's result sent back (the assistant turn with tool_calls and null content, then a
`tool` message), and a final answer whose prompt holds that result. The server is the session's shared
one (tests/conftest.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytest.importorskip("xgrammar")

from tests.conftest import API_KEY, AUTH  # noqa: E402
from tests.server.server_process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}]
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
RESULT = "It is 18 degrees and sunny in Paris."


@pytest.fixture(scope="module")
def server(api_server) -> ServerProcess:
    return api_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_call_result_and_final_answer(server, client):
    model = model_of(client)
    first = client.chat.completions.create(
        model=model, messages=[QUESTION], tools=TOOLS, max_tokens=48, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}

    # What an agent sends back: the assistant turn as it came (content null), then the tool's answer.
    assistant = first.choices[0].message.model_dump(include={"role", "content", "tool_calls"})
    assert assistant["content"] is None
    messages = [QUESTION, assistant, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=12,
                                           temperature=0.0)
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content

    # The second prompt is the one /tokenize renders from the same messages, and it holds the result.
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "tools": TOOLS}, headers=AUTH,
                        timeout=60).json()
    assert final.usage.prompt_tokens == tokens["count"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH,
                        timeout=60).json()["prompt"]
    assert f"<|im_start|>tool\n{RESULT}<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # SmolLM2's template shows no tool markup: no parser by default, said at start-up.
    assert "tool calls: not parsed" in server.log_text(tail=None)


def test_malformed_tool_turns_are_a_400_naming_the_field(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    bad = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
           {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_of(client), messages=bad, tools=TOOLS, max_tokens=4)
    assert info.value.body["param"] == "messages"
    assert "messages[1].tool_calls[0].function.arguments is not valid JSON" in info.value.body["message"]
