"""A Messages request -> the chat request the shared path runs (chat_run.ChatRunner).

`system` (a string or text blocks) becomes the system message. A user turn's `tool_result` blocks
become `tool` messages (one per result, in order, before the turn's text), an assistant turn's
`tool_use` blocks its `tool_calls` (the input object as JSON arguments); `thinking` blocks of earlier
turns are dropped (templates do not show past thoughts). Tools carry `input_schema` where OpenAI's
carry `parameters`; tool_choice `auto` / `any` / `tool` / `none` are chat's "auto" / "required" / a
named function / "none", and `disable_parallel_tool_use` is parallel_tool_calls false. Every
refusal names the field as the client sent it (`messages[1].content[0].tool_use_id`). A final
assistant turn with text is the reply's start: the reply continues it (frontend/final_message.py).
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.final_message import split_prefill


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system", "system")})
    for i, message in enumerate(req.messages):
        at = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _invalid(f"{at} must be an object with role 'user' or 'assistant'")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _invalid(f"{at}.content must be a string or a list of content blocks")
        if not content and not (message["role"] == "assistant" and i == len(req.messages) - 1):
            raise _invalid(f"{at}.content is empty (only a final assistant turn, the reply's start, may be)")
        if message["role"] == "user":
            _user_blocks(content, at, messages)
        else:
            _assistant_blocks(content, at, messages)
    _check_tool_pairs(req.messages)
    return messages


def _check_tool_pairs(turns: list[dict[str, Any]]) -> None:
    """Anthropic's rule, with its words: each tool_use block has its tool_result in the next message,
    and each tool_result answers a tool_use of the message before it (a call left unanswered would
    otherwise reach the template as a turn the model never saw the end of)."""
    asked: list[str] = []  # the previous assistant turn's tool_use ids
    for i, turn in enumerate(turns):
        blocks = [b for b in turn["content"] if isinstance(b, dict)] if isinstance(turn["content"], list) else []
        answered = []
        if turn["role"] == "user":
            for k, block in enumerate(blocks):
                if block.get("type") == "tool_result":
                    if block["tool_use_id"] not in asked:
                        raise _invalid(f"messages[{i}].content[{k}]: unexpected tool_use_id found in tool_result "
                                       f"blocks: {block['tool_use_id']}. Each tool_result block must have a "
                                       "corresponding tool_use block in the previous message")
                    answered.append(block["tool_use_id"])
        _check_answered(asked, answered, i - 1)
        asked = [b["id"] for b in blocks if b.get("type") == "tool_use"] if turn["role"] == "assistant" else []
    _check_answered(asked, [], len(turns) - 1)


def _check_answered(asked: list[str], answered: list[str], at: int) -> None:
    missing = [call for call in asked if call not in answered]
    if missing:
        raise _invalid(f"messages[{at}]: tool_use ids were found without tool_result blocks immediately after: "
                       f"{', '.join(missing)}. Each tool_use block must have a corresponding tool_result block in "
                       "the next message")


def _user_blocks(blocks: list[Any], at: str, messages: list[dict[str, Any]]) -> None:
    text = []
    for k, block in enumerate(blocks):
        where = f"{at}.content[{k}]"
        kind = _kind(block, where)
        if kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise _invalid(f"{where}.tool_use_id must be a non-empty string")
            result = block.get("content", "")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text(result, f"{where}.content") if result else ""})
        elif kind == "text":
            text.append(_block_text(block, where))
        else:
            raise _invalid(f"{where}: a user turn may hold text and tool_result blocks, got {kind!r}")
    if text:
        messages.append({"role": "user", "content": "".join(text)})


def _assistant_blocks(blocks: list[Any], at: str, messages: list[dict[str, Any]]) -> None:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(blocks):
        where = f"{at}.content[{k}]"
        kind = _kind(block, where)
        if kind == "text":
            text.append(_block_text(block, where))
        elif kind == "tool_use":
            name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
                raise _invalid(f"{where}: a tool_use block needs an 'id' and a 'name'")
            if not isinstance(args, dict):
                raise _invalid(f"{where}.input must be an object")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise _invalid(f"{where}: an assistant turn may hold text, tool_use and thinking blocks, got {kind!r}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    messages.append(message)


def _no_trailing_whitespace(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic refuses a final assistant turn (the reply's start) that ends in whitespace."""
    last = messages[-1] if messages else None
    text = last.get("content") if last is not None and last["role"] == "assistant" else None
    if isinstance(text, str) and text and text != text.rstrip():
        raise _invalid("messages: final assistant content cannot end with trailing whitespace")
    return messages


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _invalid(f"{where} must be a content block (an object with a 'type')")
    return block["type"]


def _block_text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise _invalid(f"{where}.text must be a string")
    return block["text"]


def _text(content: Any, where: str, param: str = "messages") -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{where} must be a string or a list of text blocks", param)
    pieces = []
    for k, block in enumerate(content):
        if _kind(block, f"{where}[{k}]") != "text":
            raise _invalid(f"{where}[{k}]: only text blocks are supported here, got {block['type']!r}", param)
        pieces.append(_block_text(block, f"{where}[{k}]"))
    return "".join(pieces)


def _invalid(message: str, param: str = "messages") -> InvalidRequest:
    return InvalidRequest(message, param=param)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool.get("name"), str) or tool.get("type", "custom") != "custom":
            raise _invalid(f"tools[{i}] must be a custom tool with a 'name' and an 'input_schema' (this server "
                           "runs no server tools)", "tools")
        schema = tool.get("input_schema") or {"type": "object"}
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise _invalid(f"tools[{i}].input_schema must be a JSON schema of type 'object'", "tools")
        function = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _invalid("tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}",
                   "tool_choice")


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    choice, parallel = chat_tool_choice(req.tool_choice)
    kind = (req.tool_choice or {}).get("type")
    if kind in ("any", "tool") and not req.tools:
        raise _invalid(f"tool_choice {kind!r} needs a non-empty tools list", "tool_choice")
    stops = getattr(req, "stop_sequences", None)
    if stops is not None and not (isinstance(stops, list) and all(isinstance(x, str) and x for x in stops)):
        raise _invalid("stop_sequences must be a list of non-empty strings", "stop_sequences")
    messages, flags = split_prefill(_no_trailing_whitespace(chat_messages(req)))
    body: dict[str, Any] = {"model": req.model, "messages": messages, "tools": chat_tools(req.tools),
                            "tool_choice": choice, "parallel_tool_calls": parallel, **flags}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k)
    return ChatCompletionRequest.model_validate(body)
