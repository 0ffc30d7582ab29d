"""The tool-use turns of a conversation, checked and shaped for the chat template.

An agent sends back the assistant turn that called tools (`tool_calls`, usually `content: null`)
and one `tool` message per call (`tool_call_id`, the result as content). OpenAI rejects a malformed
one with a 400 naming the field; so do we, instead of letting the template fail obscurely or render
a broken prompt. What templates see follows vLLM (and transformers' guidance): each call's
`function.arguments` as an object, not the JSON text the wire carries (Qwen's and GLM's templates
iterate or `tojson` it), and a null content as empty text (SmolLM2's template concatenates it).
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.errors import InvalidRequest


def shape_tool_fields(message: dict[str, Any], index: int) -> None:
    """Checks `message` (a plain-JSON copy) and rewrites its tool fields in place for the template."""
    role = message["role"]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            state = "is missing" if call_id is None else "must be a non-empty string"
            raise _invalid(f"messages[{index}].tool_call_id {state}: a tool message answers the call with that id")
    calls = message.get("tool_calls")
    if "tool_calls" not in message or (calls is None and role == "assistant"):
        return
    if role != "assistant":
        raise _invalid(f"messages[{index}].tool_calls: only an assistant message may carry tool calls")
    if not isinstance(calls, list) or not calls:
        raise _invalid(f"messages[{index}].tool_calls must be a non-empty list of calls")
    for k, call in enumerate(calls):
        _shape_call(call, f"messages[{index}].tool_calls[{k}]")


def _shape_call(call: Any, where: str) -> None:
    if not isinstance(call, dict):
        raise _invalid(f"{where} must be an object like {{\"id\", \"type\": \"function\", \"function\"}}")
    if call.get("type", "function") != "function":
        raise _invalid(f"{where}.type must be 'function', got {call.get('type')!r}")
    if "id" in call and not isinstance(call["id"], str):
        raise _invalid(f"{where}.id must be a string")
    function = call.get("function")
    if not isinstance(function, dict):
        raise _invalid(f"{where}.function must be an object with 'name' and 'arguments'")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _invalid(f"{where}.function.name must be a non-empty string")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        function["arguments"] = {}  # as vLLM: a call without arguments
        return
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise _invalid(f"{where}.function.arguments is not valid JSON ({exc.msg} at position {exc.pos}): "
                           "send the arguments the model returned, a JSON object as a string") from None
    if not isinstance(arguments, dict):
        raise _invalid(f"{where}.function.arguments must be a JSON object, got {type(arguments).__name__}")
    function["arguments"] = arguments


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="messages")
