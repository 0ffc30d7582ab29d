"""POST /v1/messages and /v1/messages/count_tokens, answered in Anthropic's shapes.

A request is translated to chat (translate.py), run by the shared chat_run.ChatRunner (template,
tokenizer workers, validation, overload 503s, abort on disconnect, timelines, metrics), and its one
choice's events become content blocks (output.py): a Message, or the stream `message_start`, `ping`,
the blocks' events, `message_delta` (stop reason and the final usage), `message_stop`. Failures are
Anthropic's error JSON, `{"type": "error", "error": {"type", "message"}}`, also mid-stream.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.anthropic.output import MessageBuilder, stop_reason
from tokenmill.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from tokenmill.entrypoints.anthropic.translate import chat_request
from tokenmill.entrypoints.openai.chat_run import ChatRun, ChatRunner
from tokenmill.entrypoints.openai.errors import as_request_error
from tokenmill.entrypoints.openai.serving_common import (
    SSE_HEADERS,
    ClientDisconnected,
    check_model,
    disconnected_response,
    json_response,
    parse_body,
    stamp_last_byte,
    unless_disconnected,
)
from tokenmill.frontend.choice_events import request_usage
from tokenmill.frontend.request_error import RequestError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_json(exc: BaseException) -> tuple[dict[str, Any], int, dict[str, str] | None]:
    """(Anthropic's error body, HTTP status, headers) for any failure while serving."""
    error = as_request_error(exc)
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}, error.status, error.headers


def sse(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class MessagesServing:
    async def create(self, raw: Request, runner: ChatRunner) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, MessagesRequest)
        run = await runner.start(raw, chat_request(req), arrival, request_id=f"msg_{secrets.token_hex(12)}")
        if req.stream:
            stream = stamp_last_byte(self._stream(run), runner.manager, run.request_id, arrival)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        builder = MessageBuilder()
        try:
            await unless_disconnected(raw, _build(run, builder))
        except ClientDisconnected:
            return disconnected_response()
        assert builder.finish is not None
        reason, sequence = stop_reason(builder.finish)
        body = {**_message_head(run), "content": builder.content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": _usage(run)}
        run.record.set_usage(run.usage())
        return json_response(body, runner.manager, run.request_id, arrival)

    async def count_tokens(self, raw: Request, runner: ChatRunner) -> Response:
        req = await parse_body(raw, CountTokensRequest)
        runner.manager.check_ready()
        assert runner.manager.limits is not None
        check_model(req.model, runner.manager.limits.model_name)
        ids, _ = await runner.prompt_ids(chat_request(req))
        return JSONResponse({"input_tokens": len(ids)})

    async def _stream(self, run: ChatRun) -> AsyncIterator[str]:
        head = {**_message_head(run), "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {**_usage(run), "output_tokens": 0}}
        yield sse("message_start", {"type": "message_start", "message": head})
        yield sse("ping", {"type": "ping"})
        builder = MessageBuilder()
        try:
            async for _, _, events in run.events():
                for name, payload in builder.feed(events):
                    yield sse(name, payload)
            if builder.finish is None or builder.finish.reason == "abort":
                raise RequestError("the server aborted the request before it finished", 503)
        except Exception as exc:  # the stream ends with Anthropic's error event, never hangs
            run.record.set_usage(run.usage())
            yield sse("error", error_json(exc)[0])
            return
        run.record.set_usage(run.usage())
        reason, sequence = stop_reason(builder.finish)
        # The whole usage again, as Anthropic's API sends it now: message_start went out before the first
        # output said how much of the prompt the cache served, and the SDKs take these fields over.
        yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": _usage(run)})
        yield sse("message_stop", {"type": "message_stop"})


async def _build(run: ChatRun, builder: MessageBuilder) -> None:
    async for _, _, events in run.events():
        builder.feed(events)
    if builder.finish is None or builder.finish.reason == "abort":
        raise RequestError("the server aborted the request before it finished", 503)


def _message_head(run: ChatRun) -> dict[str, Any]:
    return {"id": run.request_id, "type": "message", "role": "assistant", "model": run.model}


def _usage(run: ChatRun) -> dict[str, Any]:
    """Anthropic counts cached prompt tokens apart from the others (input_tokens excludes them)."""
    output_tokens, _, cached = request_usage(run.prompt_tokens, run.streams)
    return {"input_tokens": run.prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": output_tokens}



