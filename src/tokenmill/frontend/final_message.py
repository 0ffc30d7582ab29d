"""Continuing the conversation's final message (an assistant "prefill") instead of starting a new turn.

Why: Anthropic's Messages API and Ollama's /api/chat continue a final assistant message ("The answer
is" -> the model writes on from there), and vLLM's chat completions do it under
`continue_final_message`. A chat template only knows whole turns, so, as transformers'
`apply_chat_template(continue_final_message=True)` does, the conversation is rendered without a
generation prompt, with a marker after the final message's text, and cut where the marker lands: the
end-of-turn marks the template writes after it are gone, and the model's next token continues the
message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.errors import InvalidRequest


def _last_text_part(content: Any) -> Any:
    """A list content's last part that holds text, or None."""
    for part in reversed(content if isinstance(content, list) else []):
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            return part
    return None


def final_text(messages: Any) -> str | None:
    """The final message's text (a string, or its last text part), or None where it has none."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], Mapping):
        return None
    content = messages[-1].get("content")
    if isinstance(content, str):
        return content
    part = _last_text_part(content)
    return part["text"] if part is not None else None


def message_text(message: Mapping[str, Any]) -> str:
    """A message's whole text as a string template sees it: a string, or its text parts joined by
    newlines (chat_template.py's rule, vLLM's)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "\n".join(p["text"] for p in parts if isinstance(p, Mapping) and isinstance(p.get("text"), str))


# Appended to the final message before rendering, to find where the template wrote its end
# (transformers' marker, so a template that trims the message is cut where transformers cuts it).
_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tag_final_message(messages: list[dict[str, Any]], sent: Any) -> str:
    """Marks the end of the final message's text (its last text part) in `messages`, the copy of the
    `sent` messages that the caller renders; returns that text as sent. A final message without text
    (null content beside tool calls) has nothing to continue."""
    if final_text(sent) is None:
        raise InvalidRequest("continue_final_message needs a final message with text to continue",
                             param="continue_final_message")
    # The copy holds what `sent` held, normalized: a string, or text parts (at least one, as `sent` has).
    last = messages[-1]
    if isinstance(last["content"], str):
        text, last["content"] = last["content"], last["content"] + _TAG
        return text
    part = _last_text_part(last["content"])
    text, part["text"] = part["text"], part["text"] + _TAG
    return text


def cut_at_tag(rendered: str, text: str) -> str:
    """`rendered` (the tagged conversation, no generation prompt) up to the end of the final message's
    text, where the model's reply continues it; trailing spaces the template trimmed stay trimmed."""
    at = rendered.rfind(_TAG.strip())
    if at < 0 or text.strip() not in rendered:
        raise InvalidRequest("continue_final_message: the chat template does not write the final message's "
                             "text as it is, so the reply cannot continue it", param="continue_final_message")
    return rendered[:at] if rendered[at:at + len(_TAG)] == _TAG else rendered[:at].rstrip()


def split_prefill(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, bool]]:
    """A conversation as Anthropic's and Ollama's routes send it, and the chat request's template flags:
    a final assistant turn with text and no tool calls is the reply's start, continued; one with no
    text (empty, only spaces) starts nothing and is left out, so the reply opens its turn as usual
    (continuing it would let a template that trims content cut the turn's header short)."""
    last = messages[-1] if messages else None
    if last is None or last.get("role") != "assistant" or last.get("tool_calls"):
        return messages, {}
    if message_text(last).strip():
        return messages, {"add_generation_prompt": False, "continue_final_message": True}
    if len(messages) == 1:
        raise InvalidRequest("messages holds only an empty assistant turn: there is nothing to answer",
                             param="messages")
    return messages[:-1], {}
