"""The per-choice event stream on scripted outputs: the events each protocol translates, from the
reasoning split and the tool-call readers, and forced calls that a client can rely on."""

from __future__ import annotations

import json

from tokenmill.frontend.choice_events import (
    CallArguments,
    CallDone,
    CallStarted,
    ChoiceStream,
    Finished,
    Reasoning,
    Text,
)
from tokenmill.frontend.forced_calls import ForcedCallState
from tokenmill.frontend.reasoning_parser import get_reasoning_parser
from tokenmill.frontend.tool_parsers import get_tool_parser
from tokenmill.ipc.messages import TextOutput


def outputs(pieces: list[str], reason: str = "stop") -> list[TextOutput]:
    last = len(pieces) - 1
    return [TextOutput(request_id="r-0", text=p, token_ids=[k], finished=k == last,
                       finish_reason=reason if k == last else None, stop_reason=None, num_output_tokens=k + 1)
            for k, p in enumerate(pieces)]


def events_of(stream: ChoiceStream, pieces: list[str], reason: str = "stop") -> list:
    return [e for out in outputs(pieces, reason) for e in stream.feed(out)]


def test_text_only():
    stream = ChoiceStream()
    events = events_of(stream, ["Hel", "lo"])
    assert events == [Text("Hel"), Text("lo"), Finished("stop", None)]
    assert stream.text == "Hello" and stream.num_tokens == 2 and stream.finish_reason == "stop"


def test_thinking_then_text_then_calls_in_order():
    reasoning = get_reasoning_parser("qwen3").new_state([])
    tools = get_tool_parser("hermes").new_state()
    stream = ChoiceStream(reasoning, tools)
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    events = events_of(stream, ["<think>hm", "m</think>", "Sure.", call])
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["Reasoning", "Reasoning", "Text", "CallStarted", "CallArguments", "CallDone", "Finished"]
    assert stream.reasoning_text == "hmm" and stream.text == "Sure."
    started, args, done, finished = events[3:]
    assert (started.index, started.name) == (0, "f") and json.loads(args.delta) == {"x": 1}
    assert done.call.id == started.id and finished == Finished("tool_calls", None)


def test_streamed_fragments_are_announced_once_and_not_repeated():
    stream = ChoiceStream(tools=get_tool_parser("qwen3_coder").new_state())
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    events = events_of(stream, [text[i:i + 4] for i in range(0, len(text), 4)])
    assert sum(isinstance(e, CallStarted) for e in events) == 1
    pieces = "".join(e.delta for e in events if isinstance(e, CallArguments))
    (done,) = [e for e in events if isinstance(e, CallDone)]
    assert pieces == done.call.arguments == '{"a": 1}'


def test_parallel_tool_calls_false_keeps_the_first_call():
    stream = ChoiceStream(tools=get_tool_parser("hermes").new_state(), max_calls=1)
    calls = "".join(f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>' for n in ("a", "b"))
    events = events_of(stream, [calls])
    assert [e.name for e in events if isinstance(e, CallStarted)] == ["a"] and [c.name for c in stream.calls] == ["a"]


def test_forced_calls_cut_by_length_return_the_complete_ones():
    """The defect of issue 25: `required` under max_tokens came back as raw JSON content."""
    stream = ChoiceStream(tools=ForcedCallState(None))
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": 2}}, {"name": "a", "param'
    events = events_of(stream, [text[i:i + 9] for i in range(0, len(text), 9)], reason="length")
    assert not any(isinstance(e, Text) for e in events) and stream.text == ""
    assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == [("a", {"x": 1}), ("b", {"y": 2})]
    assert events[-1] == Finished("length", None) and stream.forced
    # each call goes out as soon as its JSON closed, not at the end
    first_done = next(k for k, e in enumerate(events) if isinstance(e, CallDone))
    assert first_done < len(events) - 3


def test_forced_single_object_and_named_function():
    stream = ChoiceStream(tools=ForcedCallState(None))
    events_of(stream, ['{"name": "a", "parameters": {}}'])
    assert [c.name for c in stream.calls] == ["a"] and stream.finish_reason == "tool_calls"
    named = ChoiceStream(tools=ForcedCallState("get"))
    events_of(named, ['{"k":', ' "v"}'])
    assert [(c.name, c.arguments) for c in named.calls] == [("get", '{"k": "v"}')]
    cut = ChoiceStream(tools=ForcedCallState("get"))
    assert [type(e) for e in events_of(cut, ['{"k": "v'], reason="length")] == [Finished]


def test_reasoning_tokens_are_counted():
    reasoning = get_reasoning_parser("deepseek_r1").new_state([])
    stream = ChoiceStream(reasoning)
    events = events_of(stream, ["a", "b</think>", "c"])
    assert [e for e in events if isinstance(e, Reasoning)] == [Reasoning("a"), Reasoning("b")]
    assert stream.reasoning_tokens == 2
