"""Read tool calls back out of a model's output (`--tool-call-parser NAME`).

The chat template shows the model the request's `tools`; each model family then writes its calls in
its own markup. `ToolCallState` (one per sequence) takes the output as it streams and returns each
delta split into content (the text outside the calls) and the calls completed so far. As with the
reasoning parser, text that may be the start of a marker is held back, so no cut `<tool_call>` (or
`[TOOL_CALLS]`) ever reaches the content whatever the token or delta boundaries; the non-streaming
answer is the same state fed all at once, so both modes agree.

- `hermes` (Qwen2.5, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
  of them, anywhere in the reply.
- `llama3_json`: the whole reply is `{"name": ..., "parameters": {...}}` (several joined by `;`),
  possibly after `<|python_tag|>` (a special token, so usually already gone from the text).
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` to the end of the reply; a reply
  that opens with the bare `[` is read the same way (`[TOOL_CALLS]` is a control token the
  detokenizer drops when skipping special tokens).
- `glm45` (GLM-4.5/4.6, vLLM's name): `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>
  ...</tool_call>`, any number of them. The template writes string values raw and others as JSON, so
  a value is read as JSON unless the tool's schema says the argument is a string (vLLM's rule) or
  it does not parse; then it is the string as written.

- `qwen3_coder` (Qwen3-Coder's XML, tool_parser_qwen3_coder.py) and `pythonic` (`[f(x=1)]`, Llama
  3.2 / 4, tool_parser_pythonic.py) have readers of their own, which stream each call's arguments.

`forced_calls.ForcedCallState` reads the output of tool_choice "required" or a named function, which a
grammar built from the tools' schemas (entrypoints/openai/params.py) made a call whatever the parser.

The JSON families emit a call only once its JSON is complete (its closing marker, or the end of the output), so
its arguments arrive in one piece. Markup whose JSON is not a call (malformed, no name) is left in
the content as the model wrote it: the client sees what the model said, never an error. Whitespace
right after a call, and at the end of a reply that made calls, is dropped, so a reply of calls alone
has no content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# The same hold-back as the reasoning markers' (a cut marker waits for the next delta).
from tokenmill.frontend.reasoning_parser import _held_suffix
from tokenmill.frontend.tool_call import (
    CallFragment,
    ToolCall,
    ToolDelta,
    Tools,
    json_or_text,
    new_call_id,
    string_arguments,
)
from tokenmill.frontend.tool_parser_pythonic import PythonicState
from tokenmill.frontend.tool_parser_qwen3_coder import Qwen3CoderState

__all__ = ["CallFragment", "CallReader", "ToolCall", "ToolDelta", "ToolParser", "get_tool_parser", "parse_calls"]


class CallReader(Protocol):
    """What the event stream feeds, one per choice: a parser's state, or forced_calls.ForcedCallState."""

    num_calls: int

    def feed(self, text: str) -> ToolDelta: ...
    def finish(self) -> ToolDelta: ...


@dataclass(frozen=True)
class ToolParser:
    """How one model family writes calls; `new_state` makes the per-sequence state."""

    name: str
    start: str  # the marker that opens a call
    end: str | None  # the marker that closes it; None: the call runs to the end of the output
    bare_start: str | None = None  # a reply opening with this (after whitespace) is a call without `start`
    # The calls in the text between the markers, or None when it is not a call (then it stays text).
    read: Callable[[str, Tools], list[ToolCall] | None] = lambda body, tools: parse_calls(body)
    # A reader of its own (streaming arguments) instead of ToolCallState's markers + `read`.
    state: Callable[[Tools], CallReader] | None = None

    def new_state(self, tools: Tools = None) -> CallReader:
        return self.state(tools) if self.state is not None else ToolCallState(self, tools)


def parse_calls(body: str) -> list[ToolCall] | None:
    """The calls in `body` (JSON objects or arrays of them, separated by whitespace, `;` or `,`),
    or None if any part is not a call: then the whole markup stays text."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = 0
    while True:
        while at < len(body) and (body[at].isspace() or body[at] in ";,"):
            at += 1
        if at == len(body):
            return calls or None
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        for item in value if isinstance(value, list) else [value]:
            call = call_of(item)
            if call is None:
                return None
            calls.append(call)


def call_of(item: object) -> ToolCall | None:
    if not isinstance(item, dict):
        return None
    name = item.get("name")
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments already encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))


# GLM-4.5's template puts a newline between the name and the first key and between key and value;
# models also write a literal backslash-n there at times (vLLM accepts both).
_GLM_GAP = r"(?:\\n|\s)*"
_GLM_ARG = re.compile(rf"{_GLM_GAP}<arg_key>(.*?)</arg_key>{_GLM_GAP}<arg_value>(.*?)</arg_value>", re.DOTALL)
_GLM_NAME = re.compile(r"[^\s<>{}\[\]\"',]+")  # a function name, not a fragment of JSON or markup


def read_glm45(body: str, tools: Tools) -> list[ToolCall] | None:
    """One `NAME<arg_key>K</arg_key><arg_value>V</arg_value>...` call; anything else in it: not a call."""
    head = body.split("<arg_key>", 1)[0]
    name = head.strip()
    if not _GLM_NAME.fullmatch(name):
        return None
    strings = string_arguments(name, tools)
    args: dict[str, Any] = {}
    at = len(head)
    while match := _GLM_ARG.match(body, at):
        key, value = match.group(1).strip(), match.group(2).strip()
        if not key:
            return None
        args[key] = value if key in strings else json_or_text(value)
        at = match.end()
    if body[at:].strip():  # an unclosed pair, or text between the pairs
        return None
    return [ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))]


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", "<tool_call>", "</tool_call>"),
    "llama3_json": ToolParser("llama3_json", "<|python_tag|>", None, bare_start="{"),
    "mistral": ToolParser("mistral", "[TOOL_CALLS]", None, bare_start="["),
    "glm45": ToolParser("glm45", "<tool_call>", "</tool_call>", read=read_glm45),
    "qwen3_coder": ToolParser("qwen3_coder", "<tool_call>", "</tool_call>", state=Qwen3CoderState),
    "pythonic": ToolParser("pythonic", "[", None, bare_start="[", state=PythonicState),
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known: {known}") from None


class ToolCallState:
    """One sequence's split; feed() every delta in order, then finish() once."""

    def __init__(self, parser: ToolParser, tools: Tools = None) -> None:
        self.parser = parser
        self.tools = tools
        self.num_calls = 0
        self._held = ""  # outside a call: text that may be a cut start marker
        self._opener: str | None = None  # inside a call: the text that opened it (a marker or "")
        self._body = ""  # inside a call: its text so far
        self._pending_ws = ""  # trailing whitespace of the content, sent only once more content follows
        self._ws_before = ""  # inside a bare call: the reply's leading whitespace, put back if it is not a call
        self._seen_content = False  # any non-whitespace content yet (a bare call must open the reply)
        self._after_call = False  # a call just closed: leading whitespace is dropped

    def feed(self, text: str) -> ToolDelta:
        content: list[str] = []
        calls: list[ToolCall] = []
        self._scan(self._held + text, content, calls)
        return ToolDelta("".join(content), tuple(calls))

    def finish(self) -> ToolDelta:
        """The output ended: a cut marker is only text after all, and an unclosed call is read as it is."""
        content: list[str] = []
        calls: list[ToolCall] = []
        held, self._held = self._held, ""
        if self._opener is not None:
            self._close(self._body, content, calls)
        elif held:
            self._content(held, content)
        if self.num_calls == 0:
            content.append(self._pending_ws)
        self._pending_ws = ""
        return ToolDelta("".join(content), tuple(calls))

    def _scan(self, text: str, content: list[str], calls: list[ToolCall]) -> None:
        self._held = ""
        start, end = self.parser.start, self.parser.end
        while text:
            if self._opener is not None:
                if end is None:
                    self._body += text
                    return
                self._body += text
                at = self._body.find(end)
                if at < 0:
                    return
                body, text = self._body[:at], self._body[at + len(end):]
                self._close(body, content, calls, closer=end)
                continue
            bare = self.parser.bare_start
            if bare is not None and not self._seen_content and self.num_calls == 0:
                stripped = text.lstrip()
                if not stripped or start.startswith(stripped):
                    self._held = text  # only whitespace or a cut marker so far: the reply may still be a call
                    return
                if stripped.startswith(bare):
                    self._open("", text[: len(text) - len(stripped)])
                    text = stripped
                    continue
            at = text.find(start)
            if at >= 0:
                self._content(text[:at], content)
                self._open(start, "")
                text = text[at + len(start):]
                continue
            keep = _held_suffix(text, start)
            self._content(text[: len(text) - keep], content)
            self._held = text[len(text) - keep:]
            return

    def _open(self, opener: str, ws_before: str) -> None:
        # Whitespace before a call stays pending: content after the call releases it, the end drops it.
        self._opener, self._body, self._ws_before = opener, "", ws_before

    def _close(self, body: str, content: list[str], calls: list[ToolCall], closer: str = "") -> None:
        opener = self._opener or ""
        self._opener, self._body = None, ""
        parsed = self.parser.read(body, self.tools)
        if parsed is None:
            self._pending_ws += self._ws_before
            self._content(opener + body + closer, content)  # not a call: the model's text as it wrote it
            return
        self.num_calls += len(parsed)
        self._after_call = True
        calls.extend(parsed)

    def _content(self, text: str, content: list[str]) -> None:
        if self._after_call:
            text = text.lstrip()  # whitespace right after a call is not content
        if not text:
            return
        text = self._pending_ws + text
        kept = text.rstrip()
        self._pending_ws = text[len(kept):]
        if kept:
            self._seen_content, self._after_call = True, False
            content.append(kept)
