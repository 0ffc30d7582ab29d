"""tool_choice "required" and a named function on the bundled model: the grammar built from the tools'
schemas makes even a 135M model write a valid call, read back by ForcedCallState."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from tests.real_model import make_llm  # noqa: E402
from tokenmill.entrypoints.openai.params import chat_sampling_params  # noqa: E402
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from tokenmill.frontend.forced_calls import ForcedCallState  # noqa: E402
from tokenmill.sample.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                      "parameters": {"type": "object", "properties": {
                                          "tz": {"type": "string", "maxLength": 20}}, "required": ["tz"]}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_gives_a_valid_call(choice):
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice})
    grammar = chat_sampling_params(req).structured_output
    llm = make_llm(num_threads=1)
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=96, temperature=0.0, structured_output=grammar),
                   tools=TOOLS)[0].outputs[0]
    state = ForcedCallState(choice["function"]["name"] if isinstance(choice, dict) else None)
    found = [state.feed(out.text), state.finish()]  # "required": each call as its JSON closes, named: at the end
    calls = [c for delta in found for c in delta.calls]
    assert calls and all(delta.content == "" for delta in found), out.text
    for call in calls:
        tool = next(t["function"] for t in TOOLS if t["function"]["name"] == call.name)
        args = json.loads(call.arguments)
        assert set(args) == set(tool["parameters"]["required"]), out.text
