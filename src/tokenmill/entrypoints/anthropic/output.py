"""A choice's events -> Anthropic content blocks, their streaming events, and the stop reason.

`MessageBuilder` is fed the events of the one choice (frontend/choice_events.py) and keeps the
content blocks it built; streamed, each feed also returns the events to send: `content_block_start`,
`content_block_delta` (`thinking_delta`, `text_delta`, `input_json_delta`), `content_block_stop`, a
block per run of one kind. The non-streamed answer runs the same builder and keeps the blocks, so
both modes agree. A tool_use block cut while its input was written is closed in the stream but left
out of the final content (its half JSON is no input a client can run).
"""

from __future__ import annotations

import json
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


def stop_reason(finish: Finished) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the choice's end."""
    if finish.reason == "tool_calls":
        return "tool_use", None
    if finish.reason == "length":
        return "max_tokens", None
    if isinstance(finish.stop_reason, str):  # a stop string matched
        return "stop_sequence", finish.stop_reason
    return "end_turn", None


class MessageBuilder:
    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []  # finished blocks, in order
        self._open: dict[str, Any] | None = None
        self._index = -1  # the open (or last) block's index in the stream
        self._done_call = False  # the open tool_use block's call completed
        self.finish: Finished | None = None

    def feed(self, events: list[Event]) -> list[tuple[str, dict[str, Any]]]:
        sent: list[tuple[str, dict[str, Any]]] = []
        for event in events:
            if isinstance(event, Reasoning):
                self._write("thinking", event.text, sent)
            elif isinstance(event, Text):
                self._write("text", event.text, sent)
            elif isinstance(event, CallStarted):
                self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}}, sent)
            elif isinstance(event, CallArguments):
                sent.append(self._delta({"type": "input_json_delta", "partial_json": event.delta}))
            elif isinstance(event, CallDone):
                assert self._open is not None
                self._open["input"] = json.loads(event.call.arguments)
                self._done_call = True
                self._close(sent)
            elif isinstance(event, Finished):
                self._close(sent)
                self.finish = event
        return sent

    def _write(self, kind: str, text: str, sent: list[tuple[str, dict[str, Any]]]) -> None:
        if self._open is None or self._open["type"] != kind:
            self._start({"type": "text", "text": ""} if kind == "text"
                        else {"type": "thinking", "thinking": "", "signature": ""}, sent)
        assert self._open is not None
        self._open[kind] += text
        sent.append(self._delta({"type": "text_delta", "text": text} if kind == "text"
                                else {"type": "thinking_delta", "thinking": text}))

    def _start(self, block: dict[str, Any], sent: list[tuple[str, dict[str, Any]]]) -> None:
        self._close(sent)
        self._open, self._done_call = block, False
        self._index += 1
        sent.append(("content_block_start", {"type": "content_block_start", "index": self._index,
                                             "content_block": dict(block)}))

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _close(self, sent: list[tuple[str, dict[str, Any]]]) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        sent.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        if block["type"] != "tool_use" or self._done_call:
            self.content.append(block)
