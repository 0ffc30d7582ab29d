"""The reader of forced tool calls: tool_choice "required" or a named function.

A grammar built from the tools' schemas (entrypoints/openai/params.forced_call_schema) made the whole
output the call(s), whatever the model family: for a named function its arguments object; for
"required" a JSON array of {"name", "parameters"} objects (vLLM's shape), or a single such object when
`parallel_tool_calls` is false. The output is never content: a client that forced a call must be
able to rely on getting calls back. So each array element is emitted as soon as its JSON closes (a
stream sends calls as they complete), and an output cut by `max_tokens` returns the calls it
completed (finish_reason "length"), dropping only the unfinished one, never showing its raw JSON.
"""

from __future__ import annotations

import json

from tokenmill.frontend.tool_call import ToolCall, ToolDelta
from tokenmill.frontend.tool_parsers import call_of


class ForcedCallState:
    def __init__(self, name: str | None) -> None:
        self.name = name
        self.num_calls = 0
        self._text = ""
        self._at = 0  # "required": where the next array element starts
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> ToolDelta:
        self._text += text
        if self.name is not None:
            return ToolDelta()  # the arguments object is read whole, at the end
        return ToolDelta("", self._complete_elements())

    def finish(self) -> ToolDelta:
        if self.name is None:
            return ToolDelta("", self._complete_elements())
        try:
            args = json.loads(self._text)
        except json.JSONDecodeError:
            return ToolDelta()  # cut short: no call completed
        call = call_of({"name": self.name, "arguments": args})
        if call is None:
            return ToolDelta()
        self.num_calls += 1
        return ToolDelta("", (call,))

    def _complete_elements(self) -> tuple[ToolCall, ...]:
        calls: list[ToolCall] = []
        text = self._text
        while True:
            at = self._at
            while at < len(text) and (text[at].isspace() or text[at] in "[,"):
                at += 1
            if at >= len(text) or text[at] == "]":
                break
            try:
                value, end = self._decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                break  # the element is still being written
            self._at = end
            call = call_of(value)
            if call is not None:
                calls.append(call)
        self.num_calls += len(calls)
        return tuple(calls)
