"""One choice's output as protocol-neutral events: the stream every wire format translates.

Chat completions, the Responses API and Anthropic's Messages API all say the same things about a
generated choice: text arrived, thinking arrived, a tool call started, its arguments grew, it finished,
the choice ended for a reason, so many tokens were spent. `ChoiceStream` (one per choice) produces
those events once, from the detokenizer's outputs through the reasoning split and the tool-call
reader, and keeps what a non-streamed answer needs (the text, the thought, the finished calls); each
protocol module then only maps events to its SSE events or its final JSON.

Ordering: within one output, thinking comes before the answer, and the answer's text before the calls
it completed. Call indexes count from 0 per choice. With `max_calls` (parallel_tool_calls false on a
free-form reply) calls past the first are dropped here; forced calls are held to one by the grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.frontend.forced_calls import ForcedCallState
from tokenmill.frontend.reasoning_parser import ReasoningState
from tokenmill.frontend.tool_call import CallFragment, ToolCall, ToolDelta
from tokenmill.frontend.tool_parsers import CallReader
from tokenmill.ipc.messages import Logprob, TextOutput


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    delta: str  # a piece of the arguments' JSON text; all of a call's pieces joined are its arguments


@dataclass(frozen=True)
class CallDone:
    index: int
    call: ToolCall


@dataclass(frozen=True)
class Finished:
    # "stop" | "length" | "abort", or "tool_calls": stopped after making calls. A "length" cut keeps
    # its reason even with calls: the calls it completed are returned, the cut one is not.
    reason: str
    stop_reason: int | str | None


Event = Text | Reasoning | CallStarted | CallArguments | CallDone | Finished


class ChoiceStream:
    """feed() every TextOutput of one choice in order; read the totals after the last."""

    def __init__(self, reasoning: ReasoningState | None = None, tools: CallReader | None = None,
                 max_calls: int | None = None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._max_calls = max_calls
        self._index_of: dict[str, int] = {}  # call id -> index, for calls announced so far
        self._dropped: set[str] = set()  # call ids past max_calls
        self.content: list[str] = []
        self.thought: list[str] = []
        self.calls: list[ToolCall] = []
        self.logprobs: list[Logprob] = []
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None  # the event's reason, once finished
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: list[Logprob | None] | None = None

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.thought)

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning.reasoning_tokens if self._reasoning is not None else 0

    @property
    def forced(self) -> bool:
        """tool_choice "required" or a named function: the reply is calls only."""
        return isinstance(self._tools, ForcedCallState)

    @property
    def num_calls(self) -> int:
        return len(self._index_of)

    def feed(self, out: TextOutput) -> list[Event]:
        self.num_tokens = out.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.logprobs.extend(out.logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        events: list[Event] = []
        thought, answer = self._split(out)
        if thought:
            self.thought.append(thought)
            events.append(Reasoning(thought))
        if self._tools is None:
            self._text(answer, events)
        else:
            found = [self._tools.feed(answer)] + ([self._tools.finish()] if out.finished else [])
            self._text("".join(d.content for d in found), events)
            for delta in found:
                self._calls(delta, events)
        if out.finished:
            reason = out.finish_reason or "stop"
            if reason == "stop" and self.calls:
                reason = "tool_calls"
            self.finish_reason, self.stop_reason = reason, out.stop_reason
            events.append(Finished(reason, out.stop_reason))
        return events

    def _split(self, out: TextOutput) -> tuple[str, str]:
        if self._reasoning is None:
            return "", out.text
        parts = [self._reasoning.feed(out.text, out.token_ids)]
        if out.finished:
            parts.append(self._reasoning.finish())
        return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)

    def _text(self, text: str, events: list[Event]) -> None:
        if text:
            self.content.append(text)
            events.append(Text(text))

    def _calls(self, delta: ToolDelta, events: list[Event]) -> None:
        for fragment in delta.fragments:
            index = self._announce(fragment, events)
            if index is not None and fragment.arguments:
                events.append(CallArguments(index, fragment.arguments))
        for call in delta.calls:
            was_announced = call.id in self._index_of
            index = self._announce(CallFragment(call.id, call.name, ""), events)
            if index is None:
                continue
            if not was_announced:
                events.append(CallArguments(index, call.arguments))  # a reader that sends calls whole
            self.calls.append(call)
            events.append(CallDone(index, call))

    def _announce(self, fragment: CallFragment, events: list[Event]) -> int | None:
        """The call's index, announcing it first if it is new; None for a call past max_calls."""
        if fragment.id in self._dropped:
            return None
        index = self._index_of.get(fragment.id)
        if index is None:
            if self._max_calls is not None and len(self._index_of) >= self._max_calls:
                self._dropped.add(fragment.id)
                return None
            index = self._index_of[fragment.id] = len(self._index_of)
            events.append(CallStarted(index, fragment.id, fragment.name))
        return index


def request_usage(prompt_tokens: int, streams: Sequence[ChoiceStream]) -> tuple[int, int, int]:
    """(output tokens, reasoning tokens, cached prompt tokens) over a request's choices of one prompt."""
    cached = min((s.num_cached_tokens for s in streams), default=0)
    return sum(s.num_tokens for s in streams), sum(s.reasoning_tokens for s in streams), cached
