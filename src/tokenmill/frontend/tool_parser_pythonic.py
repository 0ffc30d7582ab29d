"""Pythonic tool calls (`--tool-call-parser pythonic`): Llama 3.2 / Llama 4 write a Python list of calls.

    [get_weather(city="Paris"), get_time(tz="CET")]

A reply is calls only if it opens with `[` (after whitespace); the list's elements are read one by one
as each closes (a `,` or the `]` at the list's own depth, brackets and string quotes tracked across
deltas), so calls stream as they complete. Each element must be `name(keyword=literal, ...)`; values
are Python literals (`True`, `None`, dicts, lists), sent as JSON. Until the first element proves to be a
call, the text is held; a first element that is not one (`[1] First, ...`) makes the whole reply
content. Text after the list's `]` is content; an element cut by the end of the output is dropped
when calls came before it, and is content otherwise.
"""

from __future__ import annotations

import ast
import json

from tokenmill.frontend.tool_call import ToolCall, ToolDelta, Tools, new_call_id

_OPEN, _CLOSE = "([{", ")]}"


def read_call(source: str) -> ToolCall | None:
    """One `name(k=v, ...)` element as a call, or None if it is anything else."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        arguments = json.dumps(args, ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError):
        return None
    if len(args) != len(node.keywords):
        return None  # a **kwargs splat
    return ToolCall(new_call_id(), ast.unparse(node.func), arguments)


class PythonicState:
    def __init__(self, tools: Tools = None) -> None:
        self.num_calls = 0
        self._mode = "start"  # "list": inside the calls; "content": plain text from here on
        self._held = ""  # start: the reply so far; list: the element being written
        self._depth = 0  # brackets open inside the current element
        self._quote: str | None = None
        self._escape = False

    def feed(self, text: str) -> ToolDelta:
        return self._scan(text)

    def finish(self) -> ToolDelta:
        held, self._held = self._held, ""
        if self._mode == "list" and self.num_calls == 0:
            return ToolDelta("[" + held)  # never proved to be calls
        if self._mode == "start":
            return ToolDelta(held)
        return ToolDelta()  # a cut element after complete calls: dropped

    def _scan(self, text: str) -> ToolDelta:
        if self._mode == "content":
            return ToolDelta(text)
        calls: list[ToolCall] = []
        if self._mode == "start":
            self._held += text
            stripped = self._held.lstrip()
            if not stripped:
                return ToolDelta()
            if not stripped.startswith("["):
                self._mode, held, self._held = "content", self._held, ""
                return ToolDelta(held)
            self._mode, text, self._held = "list", stripped[1:], ""
        for at, char in enumerate(text):
            if self._quote is not None:
                self._held += char
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == self._quote:
                    self._quote = None
                continue
            if self._depth == 0 and char in ",]":
                element, self._held = self._held, ""
                if element.strip():
                    call = read_call(element)
                    if call is None:
                        return self._not_calls(element + text[at:], calls)
                    calls.append(call)
                    self.num_calls += 1
                if char == "]":
                    self._mode = "content"
                    return ToolDelta(text[at + 1:].strip() if calls or self.num_calls else text[at + 1:],
                                     tuple(calls))
                continue
            self._held += char
            if char in "\"'":
                self._quote = char
            elif char in _OPEN:
                self._depth += 1
            elif char in _CLOSE:
                self._depth = max(0, self._depth - 1)
        return ToolDelta("", tuple(calls))

    def _not_calls(self, rest: str, calls: list[ToolCall]) -> ToolDelta:
        """An element that is no call: the rest is content (all of it, "[" included, if nothing was a call)."""
        self._mode = "content"
        if self.num_calls == 0:
            return ToolDelta("[" + rest)
        return ToolDelta(rest.lstrip(", "), tuple(calls))
