"""Qwen3-Coder's tool calls (`--tool-call-parser qwen3_coder`): XML inside `<tool_call>` markers.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The template writes string values raw and other values as JSON, so a value is read as JSON unless the
tool's schema types the parameter as a string (the rule glm45 follows too); one newline on each side of
a value is the template's layout, not the value. Arguments stream: the call is announced once its
function name is known, and each parameter is sent as a JSON fragment once it closes, so a client
sees `{"city": "Paris"`, then `, "unit": "celsius"`, then `}`; the fragments joined are the call's
arguments. A parameter closes at `</parameter>`, or at the next `<parameter=` / `</function>` (models
drop the closing tag at times). Markup with no `<function=NAME>` stays content, as the model wrote it;
a call still open when the output ends is completed if no parameter was left half-written.
"""

from __future__ import annotations

import json
import re

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

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>))", re.DOTALL)
_FUNCTION_END = re.compile(r"\s*</function>")


class Qwen3CoderState:
    def __init__(self, tools: Tools = None) -> None:
        self.tools = tools
        self.num_calls = 0
        self._phase = "outside"  # "call": inside <tool_call>; "closing": after </function>
        self._buf = ""  # text not yet read (a cut marker, a parameter still being written)
        self._id: str | None = None  # the open call's, once its function name was read
        self._name = ""
        self._args: list[str] = []  # fragments sent for the open call
        self._pending_ws = ""
        self._after_call = False

    def feed(self, text: str) -> ToolDelta:
        out = _Out()
        self._scan(self._buf + text, out)
        return out.delta()

    def finish(self) -> ToolDelta:
        out = _Out()
        rest, self._buf = self._buf, ""
        if self._phase == "call":
            if self._id is None:
                self._content(START + rest, out)
            elif "<parameter=" not in rest:
                self._close(out)  # ended without </function>, but no parameter was cut
        elif self._phase == "outside":
            self._content(rest, out)
        if self.num_calls == 0:
            out.content.append(self._pending_ws)
        self._pending_ws = ""
        return out.delta()

    def _scan(self, text: str, out: _Out) -> None:
        self._buf = ""
        while text:
            if self._phase == "outside":
                at = text.find(START)
                if at < 0:
                    keep = _held_suffix(text, START)
                    self._content(text[: len(text) - keep], out)
                    self._buf = text[len(text) - keep:]
                    return
                self._content(text[:at], out)
                self._phase, self._id, self._args = "call", None, []
                text = text[at + len(START):]
            elif self._phase == "closing":
                stripped = text.lstrip()
                if stripped.startswith(END):
                    self._phase, text = "outside", stripped[len(END):]
                elif not stripped or END.startswith(stripped):
                    self._buf = stripped
                    return
                else:
                    self._phase = "outside"  # no closing marker: what follows is content
            else:
                text = self._read_call(text, out)

    def _read_call(self, text: str, out: _Out) -> str:
        """Reads what it can of the open call; returns the text after it, or "" keeping the rest."""
        at = 0
        if self._id is None:
            match = _FUNCTION.match(text)
            if match is None:
                head = text.lstrip()
                if not head or head.startswith("<function=") or "<function=".startswith(head):
                    self._buf = text  # the function tag may still come
                    return ""
                self._phase = "outside"  # no function inside: the markup is the model's text
                self._content(START, out)
                return text
            self._id, self._name, at = new_call_id(), match.group(1), match.end()
            out.fragments.append(CallFragment(self._id, self._name, ""))
        while (match := _PARAM.match(text, at)) is not None:
            if match.end() == len(text) and not text.endswith("</parameter>"):
                break  # the value may still grow
            self._param(match.group(1).strip(), match.group(2), out)
            at = match.end()
        done = _FUNCTION_END.match(text, at)
        if done is not None:
            self._close(out)
            return text[done.end():]
        end = text.find(END, at)
        if end >= 0 and "<parameter=" not in text[at:end]:
            self._close(out)  # </tool_call> without </function>
            return text[end:]
        self._buf = text[at:]
        return ""

    def _param(self, key: str, raw: str, out: _Out) -> None:
        assert self._id is not None
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        parsed = value if key in string_arguments(self._name, self.tools) else json_or_text(value)
        piece = ("{" if not self._args else ", ") + json.dumps(key, ensure_ascii=False) + ": " \
            + json.dumps(parsed, ensure_ascii=False)
        self._args.append(piece)
        out.fragments.append(CallFragment(self._id, self._name, piece))

    def _close(self, out: _Out) -> None:
        assert self._id is not None
        tail = "}" if self._args else "{}"
        out.fragments.append(CallFragment(self._id, self._name, tail))
        out.calls.append(ToolCall(self._id, self._name, "".join(self._args) + tail))
        self.num_calls += 1
        self._after_call = True
        self._phase, self._id, self._args = "closing", None, []

    def _content(self, text: str, out: _Out) -> None:
        if self._after_call:
            text = text.lstrip()  # whitespace right after a call is not content
        if not text:
            return
        text = self._pending_ws + text
        kept = text.rstrip()
        self._pending_ws = text[len(kept):]  # sent only once more content follows
        if kept:
            self._after_call = False
            out.content.append(kept)


class _Out:
    """What one feed() or finish() found, gathered in order."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.fragments: list[CallFragment] = []

    def delta(self) -> ToolDelta:
        return ToolDelta("".join(self.content), tuple(self.calls), tuple(self.fragments))
