"""The agent protocols on a real `tokenmill serve` with the bundled model, driven by the real clients,
unmodified but for base_url and the key: the `openai` SDK's Responses calls, the OpenAI Agents SDK running an agent
with a Python function tool, the `anthropic` SDK, and chat's forced calls that issue 25 found broken.
On the 135M model calls are made under tool_choice required / named (grammar-constrained, so valid);
free-form calls are the model's business. The session's shared server (conftest.py, --api-key)."""

from __future__ import annotations

import json
from typing import Annotated

import anthropic
import httpx
import openai
import pydantic
import pytest

pytest.importorskip("xgrammar")

from tests.conftest import API_KEY, AUTH  # noqa: E402
from tests.server.server_process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow

CITY = {"type": "string", "maxLength": 20}  # bounded: a 135M model may otherwise write one long string
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": CITY},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
                                      "parameters": {"type": "object", "properties": {"city": CITY},
                                                     "required": ["city"]}}},
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
QUESTION = "What is the weather in Paris?"
RESULT = "18 degrees and sunny."


@pytest.fixture(scope="module")
def server(api_server) -> ServerProcess:
    return api_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_chat_required_cut_by_max_tokens_returns_the_calls_it_completed(client, model):
    """Issue 25's defect: the calls came back as raw JSON in `content`, with no tool_calls."""
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                          tools=CHAT_TOOLS, tool_choice="required", max_tokens=120, temperature=0.0)
    choice = resp.choices[0]
    assert choice.message.content is None and choice.message.tool_calls, choice
    assert choice.finish_reason in ("length", "tool_calls")
    for call in choice.message.tool_calls:
        assert set(json.loads(call.function.arguments)) == {"city"}


def test_chat_parallel_tool_calls_false_is_exactly_one_call(client, model):
    for stream in (False, True):
        kwargs = dict(model=model, messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS,
                      tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0.0)
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
            continue
        heads = [c for chunk in client.chat.completions.create(stream=True, **kwargs)
                 for c in (chunk.choices[0].delta.tool_calls or []) if c.id]
        assert len(heads) == 1


def test_responses_create_and_stream_with_a_function_tool_round_trip(client, model):
    first = client.responses.create(model=model, input=QUESTION, tools=RESPONSES_TOOLS, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0.0)
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert first.status == "completed" and call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    with client.responses.stream(model=model, input=result, previous_response_id=first.id, tools=RESPONSES_TOOLS,
                                 max_output_tokens=16, temperature=0.0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    # A reply cut by max_output_tokens ends with response.incomplete, as OpenAI's does (and then the SDK's
    # get_final_response() raises: it waits for response.completed only).
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert final.output_text and final.usage.input_tokens > first.usage.input_tokens
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text
    assert client.responses.input_items.list(final.id).data[0].type == "function_call_output"


def test_responses_parse_with_a_pydantic_format(client, model):
    class Weather(pydantic.BaseModel):
        city: Annotated[str, pydantic.Field(max_length=20)]
        degrees: int

    resp = client.responses.parse(model=model, input=f"{QUESTION} Answer as JSON.", text_format=Weather,
                                  max_output_tokens=60, temperature=0.0)
    assert isinstance(resp.output_parsed, Weather)


def test_an_openai_agents_sdk_agent_calls_a_python_tool_and_answers(server, model):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, pydantic.Field(max_length=20)]) -> str:
        """Current weather in a city."""
        seen.append(city)
        return RESULT

    async_client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=180)
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather the tool gives.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=async_client),
        # required on the first turn (the 135M model calls nothing freely); the SDK resets it to auto after
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=40, temperature=0.0),
    )
    result = agents.Runner.run_sync(agent, QUESTION, max_turns=4)
    assert len(seen) >= 1 and isinstance(result.final_output, str) and result.final_output
    assert any(item.type == "tool_call_output_item" and item.output == RESULT for item in result.new_items)


def test_anthropic_messages_with_a_tool_round_trip(server, model):
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=180)
    user = [{"role": "user", "content": QUESTION}]
    # This SDK takes no `temperature` (the server's default, 1.0, samples): the named tool's grammar still
    # makes the call valid.
    msg = claude.messages.create(model=model, max_tokens=60, messages=user, tools=ANTHROPIC_TOOLS,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = msg.content
    assert msg.stop_reason == "tool_use" and use.type == "tool_use" and set(use.input) == {"city"}
    turns = [*user, {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    count = claude.messages.count_tokens(model=model, messages=turns, tools=ANTHROPIC_TOOLS)
    with claude.messages.stream(model=model, max_tokens=16, messages=turns, tools=ANTHROPIC_TOOLS) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1
    assert all(block.type == "text" for block in final.content)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count.input_tokens


def _finished_count(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=60, headers=AUTH).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tokenmill:request_success_total"))


def test_the_new_endpoints_share_timelines_metrics_and_the_request_log(server, client, model):
    before = _finished_count(server)
    resp = client.responses.create(model=model, input="Hi", max_output_tokens=4)
    raw = httpx.post(f"{server.url}/v1/messages", timeout=120, headers={"x-api-key": API_KEY},
                     json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert raw.status_code == 200 and raw.headers["x-request-id"] == raw.json()["id"]
    for request_id in (resp.id, raw.json()["id"]):
        timeline = httpx.get(f"{server.url}/v1/requests/{request_id}/timeline", timeout=60, headers=AUTH)
        assert timeline.status_code == 200 and timeline.json()["sequences"][0]["frontend"]["tokenized"] is not None
    assert _finished_count(server) >= before + 2


def test_a_prefilled_reply_is_continued_on_the_real_model(server, client, model):
    turns = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]
    chat = client.chat.completions.create(model=model, messages=turns, temperature=0, max_tokens=4,
                                          extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                      "echo": True})
    assert chat.choices[0].message.content.startswith("The capital of France is Paris")
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=180)
    msg = claude.messages.create(model=model, max_tokens=4, messages=turns, extra_body={"temperature": 0})
    assert msg.content[0].text.startswith(" Paris")
