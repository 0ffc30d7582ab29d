"""Continuing the conversation's final message (an assistant "prefill") instead of starting a new turn.

Why: Anthropic's Messages API and Ollama's /api/chat continue a final assistant message ("The answer
is" -> the model writes on from there), and vLLM's chat completions do it under
`continue_final_message`. A chat template only knows whole turns, so, as transformers'
`apply_chat_template(continue_final_message=True)` does, the conversation is rendered without a
generation prompt and the text is cut right after the final message's content: the end-of-turn marks
the template writes after it are gone, and the model's next token continues the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.errors import InvalidRequest


def final_text(messages: Any) -> str | None:
    """The final message's text (a string, or its last text part), or None where it has none."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], Mapping):
        return None
    content = messages[-1].get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                return part["text"]
    return None


def cut_after_final_message(rendered: str, messages: Any) -> str:
    """`rendered` (the whole conversation, no generation prompt) up to the end of the final message's
    text, where the model's reply continues it."""
    text = final_text(messages)
    if not text or not text.strip():
        raise InvalidRequest("continue_final_message needs a final message with text to continue",
                             param="continue_final_message")
    # Templates often trim a message (`content | trim`): look for the trimmed text, then keep what the
    # template kept of the message's leading and trailing spaces.
    at = rendered.rfind(text.strip())
    if at < 0:
        raise InvalidRequest("continue_final_message: the chat template does not write the final message's "
                             "text as it is, so the reply cannot continue it", param="continue_final_message")
    kept = text.lstrip()
    end = at + len(kept) if rendered[at:at + len(kept)] == kept else at + len(text.strip())
    return rendered[:end]


def prefill_flags(messages: list[dict[str, Any]]) -> dict[str, bool]:
    """The chat request's template flags for a conversation that ends with an assistant's text and no
    tool calls (Anthropic's and Ollama's prefill): continue it rather than open a new turn."""
    last = messages[-1] if messages else None
    if last is None or last.get("role") != "assistant" or last.get("tool_calls") or not (final_text(messages) or "").strip():
        return {}
    return {"add_generation_prompt": False, "continue_final_message": True}
