"""A Responses request -> the chat request the shared path runs (chat_run.ChatRunner).

`input` is a string (one user message) or a list of items: messages (`role` + `content`, a string or
`input_text` / `output_text` parts), `function_call` items (the model's earlier calls) and
`function_call_output` items (their results). Output items of an earlier response are valid input
too, so the same reader turns a stored conversation back into messages for `previous_response_id`.
Consecutive calls join the assistant turn before them, as one chat message with `tool_calls`;
`reasoning` items are dropped (templates do not show past thoughts). `instructions` become the
system message; `developer` is a system message too (small models' templates know no developer role).
Every refusal names the field as the client sent it (`input[2].call_id`, `tools[0].type`).
"""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.responses.protocol import ResponsesRequest
from tokenmill.errors import InvalidRequest

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def input_messages(items: str | list[Any], where: str = "input") -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _invalid(f"{at} must be an object (a message or a function_call / function_call_output item)")
        kind = item.get("type", "message")
        if kind == "message":
            _message(item, at, messages)
        elif kind == "function_call":
            _function_call(item, at, messages)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", at)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{at}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise _invalid(f"{at}.type {kind!r} is not supported (message, function_call, function_call_output, "
                           "reasoning)")
    return messages


def _message(item: dict[str, Any], at: str, messages: list[dict[str, Any]]) -> None:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise _invalid(f"{at}.role must be 'user', 'assistant', 'system' or 'developer', got {role!r}")
    text = _text(item.get("content"), f"{at}.content")
    messages.append({"role": "system" if role == "developer" else role, "content": text})


def _function_call(item: dict[str, Any], at: str, messages: list[dict[str, Any]]) -> None:
    call = {"id": _string(item, "call_id", at), "type": "function",
            "function": {"name": _string(item, "name", at), "arguments": item.get("arguments") or "{}"}}
    if not isinstance(call["function"]["arguments"], str):
        raise _invalid(f"{at}.arguments must be a string (the JSON text of the arguments)")
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        last["content"] = last.get("content") or None
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{at} must be a string or a list of text parts")
    pieces = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind in _TEXT_PARTS:
                raise _invalid(f"{at}[{k}].text must be a string")
            raise _invalid(f"{at}[{k}]: only text parts are supported (input_text, output_text), got {kind!r}")
        pieces.append(part["text"])
    return "".join(pieces)


def _string(item: dict[str, Any], key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _invalid(f"{at}.{key} must be a non-empty string")
    return value


def _invalid(message: str, param: str = "input") -> InvalidRequest:
    return InvalidRequest(message, param=param)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools ({"type": "function", "name", "parameters"}) in chat's shape."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _invalid(f"tools[{i}].type must be 'function' (this server runs no built-in tools), "
                           f"got {tool.get('type')!r}", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _invalid('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                   "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (the grammar backend constrains it the same way)."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise _invalid("text.format must be an object", "text")
    kind = spec.get("type", "text")
    if kind == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise _invalid("text.format of type 'json_schema' needs a 'schema' object", "text")
        return {"type": "json_schema", "json_schema": {"name": spec.get("name", "output"), "schema": spec["schema"]}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise _invalid(f"text.format.type must be 'text', 'json_schema' or 'json_object', got {kind!r}", "text")


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request for `req`, after the messages of the conversation it continues."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history + input_messages(req.input)
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req.text), "max_tokens": req.max_output_tokens,
    }
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "priority"):
        body[key] = getattr(req, key)
    return ChatCompletionRequest.model_validate(body)
