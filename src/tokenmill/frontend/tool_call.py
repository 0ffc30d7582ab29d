"""What every tool-call reader returns: a call, a delta of one sequence's output, and a call's
arguments arriving in pieces.

The readers (tool_parsers.py for the JSON-in-markers families, tool_parser_qwen3_coder.py,
tool_parser_pythonic.py, forced_calls.py) all answer `feed(text) -> ToolDelta` and `finish()`; the
per-choice event stream (choice_events.py) turns those deltas into the events every protocol
translates. The types live here, below all of them, so a reader in its own module imports no other.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

Tools = list[dict[str, Any]] | None  # the request's tools (OpenAI's shape, checked by params.check_tools)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, as OpenAI's function.arguments


@dataclass(frozen=True)
class CallFragment:
    """A piece of a call still being written (readers that stream arguments): the first fragment
    of a call id names it; the arguments of all its fragments joined are the finished call's."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolDelta:
    content: str = ""
    calls: tuple[ToolCall, ...] = ()  # calls completed by this delta
    fragments: tuple[CallFragment, ...] = ()  # pieces of calls, before (or as) they complete


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def string_arguments(name: str, tools: Tools) -> set[str]:
    """The arguments of tool `name` its schema types as strings: their values stay text even when they
    look like JSON ("42", "true")."""
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {k for k, v in properties.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


def json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
