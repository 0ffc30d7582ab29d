"""A choice's events -> the Responses API's output items and its semantic stream events.

`ResponseBuilder` is fed the events of the one choice (frontend/choice_events.py) and keeps the output
items it built; streamed, each feed also returns the SSE events to send, in the documented order:
`response.output_item.added`, for a message `response.content_part.added` then
`response.output_text.delta`s, for a call `response.function_call_arguments.delta`s, then the
matching `...done` events and `response.output_item.done`. The non-streamed answer runs the same
builder and keeps only the items, so both modes return the same response. A call whose arguments
were still being written when the output ended is closed as "incomplete" and left out of the final
output (its half JSON is no call a client can run, and never becomes text).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from tokenmill.frontend.choice_events import (
    CallArguments,
    CallDone,
    CallStarted,
    Event,
    Finished,
    Reasoning,
    Text,
)


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ResponseBuilder:
    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []  # finished items, in output order
        self._open: dict[str, Any] | None = None  # the item being written
        self._index = -1  # output_index of the open (or last) item
        self._calls: dict[int, dict[str, Any]] = {}  # event call index -> its function_call item
        self._done: set[str] = set()  # ids of the call items whose call completed
        self.finish_reason: str | None = None

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, Reasoning):
                self._write("reasoning", event.text, sent)
            elif isinstance(event, Text):
                self._write("message", event.text, sent)
            elif isinstance(event, CallStarted):
                self._close(sent)
                item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": event.id,
                        "name": event.name, "arguments": ""}
                self._calls[event.index] = item
                self._add(item, sent)
            elif isinstance(event, CallArguments):
                item = self._calls[event.index]
                item["arguments"] += event.delta
                sent.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                             "output_index": self._index, "delta": event.delta})
            elif isinstance(event, CallDone):
                item = self._calls[event.index]
                item["arguments"] = event.call.arguments
                self._done.add(item["id"])
                sent.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                             "output_index": self._index, "name": item["name"], "arguments": item["arguments"]})
                self._close(sent)
            elif isinstance(event, Finished):
                self._close(sent, status="incomplete" if event.reason == "length" else "completed")
                self.finish_reason = event.reason
        return sent

    def _write(self, kind: str, text: str, sent: list[dict[str, Any]]) -> None:
        if self._open is None or self._open["type"] != kind:
            self._close(sent)
            if kind == "message":
                item = {"id": item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}
            else:
                item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": []}
            self._add(item, sent)
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []} if kind == "message"
                    else {"type": "reasoning_text", "text": ""})
            item["content"].append(part)
            if kind == "message":
                sent.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": self._index,
                             "content_index": 0, "part": dict(part)})
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        delta = {"type": name, "item_id": item["id"], "output_index": self._index, "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        sent.append(delta)

    def _add(self, item: dict[str, Any], sent: list[dict[str, Any]]) -> None:
        self._open = item
        self._index += 1
        sent.append({"type": "response.output_item.added", "output_index": self._index, "item": dict(item)})

    def _close(self, sent: list[dict[str, Any]], status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        ids = {"item_id": item["id"], "output_index": self._index}
        if item["type"] == "message":
            part = item["content"][0]
            sent.append({"type": "response.output_text.done", **ids, "content_index": 0, "text": part["text"],
                         "logprobs": []})
            sent.append({"type": "response.content_part.done", **ids, "content_index": 0, "part": part})
        elif item["type"] == "reasoning":
            sent.append({"type": "response.reasoning_text.done", **ids, "content_index": 0,
                         "text": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            status = "completed" if item["id"] in self._done else "incomplete"  # else cut while being written
        if item["type"] != "reasoning":
            item["status"] = status
        sent.append({"type": "response.output_item.done", "output_index": self._index, "item": item})
        if not (item["type"] == "function_call" and status == "incomplete"):
            self.output.append(item)


def usage_of(prompt_tokens: int, output_tokens: int, reasoning_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(response_id: str, model: str, request: dict[str, Any], *, status: str,
                    output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None, created_at: int | None = None) -> dict[str, Any]:
    """The Response object; `request` holds the fields a response echoes (tools, tool_choice, ...)."""
    return {
        "id": response_id, "object": "response", "created_at": created_at or int(time.time()), "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model, "output": output if output is not None else [], "usage": usage, **request,
    }
