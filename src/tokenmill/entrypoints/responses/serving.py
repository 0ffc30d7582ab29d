"""POST /v1/responses and the stored responses' GET / DELETE / input_items.

A request is translated to chat (input_items.py), run by the shared chat_run.ChatRunner (template,
tokenizer workers, validation, overload 503s, abort on disconnect, timelines, metrics), and its
one choice's events are built into output items (output.py), streamed as semantic events or returned
whole. `previous_response_id` continues a stored conversation of the same API key (store.py).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.openai.chat_run import ChatRun, ChatRunner
from tokenmill.entrypoints.openai.errors import as_request_error
from tokenmill.entrypoints.openai.serving_common import (
    SSE_HEADERS,
    ClientDisconnected,
    disconnected_response,
    json_response,
    parse_body,
    stamp_last_byte,
    unless_disconnected,
)
from tokenmill.entrypoints.responses.input_items import chat_request, input_messages
from tokenmill.entrypoints.responses.output import ResponseBuilder, item_id, response_object, usage_of
from tokenmill.entrypoints.responses.protocol import ResponsesRequest
from tokenmill.entrypoints.responses.store import ResponseStore, StoredResponse, owner_of
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.choice_events import request_usage
from tokenmill.frontend.request_error import RequestError

# The chat path names chat's fields; a Responses client sent these instead.
_RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
# Where a message starts with chat's field, the field a Responses client sent (message indices are not
# mapped: instructions and a previous response shift them).
_RENAMED_IN_TEXT = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


class ResponsesServing:
    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store or ResponseStore()

    async def create(self, raw: Request, runner: ChatRunner, token: str | None) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, ResponsesRequest)
        owner = owner_of(token)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(owner, req.previous_response_id)
            if previous is None:
                raise RequestError(f"no stored response {req.previous_response_id!r} (responses are kept in "
                                   "memory, per API key, for a bounded number)", 404, "previous_response_id",
                                   "previous_response_not_found")
            history = previous.messages
        try:
            chat = chat_request(req, history)
            run = await runner.start(raw, chat, arrival, request_id=f"resp_{secrets.token_hex(24)}")
        except (RequestError, InvalidRequest) as exc:
            raise _renamed(exc) from None
        echo = _echo(req)
        conversation = history + input_messages(req.input)
        if req.stream:
            stream = self._stream(run, echo, req, owner, conversation)
            stream = stamp_last_byte(stream, runner.manager, run.request_id, arrival)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        builder = ResponseBuilder()
        try:
            await unless_disconnected(raw, _build(run, builder))
        except ClientDisconnected:
            return disconnected_response()
        body = self._finish(run, builder, echo, req, owner, conversation)
        run.record.set_usage(run.usage())
        return json_response(body, runner.manager, run.request_id, arrival)

    def _finish(self, run: ChatRun, builder: ResponseBuilder, echo: dict[str, Any], req: ResponsesRequest,
                owner: str, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        output_tokens, reasoning_tokens, cached = request_usage(run.prompt_tokens, run.streams)
        status = "incomplete" if builder.finish_reason == "length" else "completed"
        body = response_object(run.request_id, run.model, echo, status=status, output=builder.output,
                               usage=usage_of(run.prompt_tokens, output_tokens, reasoning_tokens, cached))
        if req.store is not False:
            messages = conversation + input_messages(builder.output, "output")
            self.store.put(owner, body, _as_items(req.input), messages)
        return body

    async def _stream(self, run: ChatRun, echo: dict[str, Any], req: ResponsesRequest, owner: str,
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        number = 0

        def event(payload: dict[str, Any]) -> str:
            nonlocal number
            payload["sequence_number"] = number
            number += 1
            return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        head = response_object(run.request_id, run.model, echo, status="in_progress")
        yield event({"type": "response.created", "response": head})
        yield event({"type": "response.in_progress", "response": head})
        builder = ResponseBuilder()
        try:
            async for _, _, events in run.events():
                for payload in builder.feed(events):
                    yield event(payload)
            if builder.finish_reason == "abort":
                raise RequestError("the server aborted the request before it finished", 503)
        except Exception as exc:  # the stream ends as a failed response, never hangs
            error = as_request_error(exc)
            run.record.set_usage(run.usage())
            failed = response_object(run.request_id, run.model, echo, status="failed", output=builder.output,
                                     error={"code": error.code or "server_error", "message": error.message})
            yield event({"type": "response.failed", "response": failed})
            yield event({"type": "error", "code": error.code, "message": error.message, "param": error.param})
            return
        body = self._finish(run, builder, echo, req, owner, conversation)
        run.record.set_usage(run.usage())
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield event({"type": kind, "response": body})

    def retrieve(self, response_id: str, token: str | None) -> JSONResponse:
        return JSONResponse(self._stored(response_id, token).response)

    def delete(self, response_id: str, token: str | None) -> JSONResponse:
        self._stored(response_id, token)
        self.store.delete(owner_of(token), response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def input_items(self, response_id: str, token: str | None) -> JSONResponse:
        items = self._stored(response_id, token).input_items
        return JSONResponse({"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                             "last_id": items[-1]["id"] if items else None, "has_more": False})

    def _stored(self, response_id: str, token: str | None) -> StoredResponse:
        entry = self.store.get(owner_of(token), response_id)
        if entry is None:
            raise RequestError(f"no stored response {response_id!r}", 404, "response_id", "response_not_found")
        return entry


async def _build(run: ChatRun, builder: ResponseBuilder) -> None:
    async for _, _, events in run.events():
        builder.feed(events)
    if builder.finish_reason == "abort":
        raise RequestError("the server aborted the request before it finished", 503)


def _renamed(exc: RequestError | InvalidRequest) -> RequestError:
    error = as_request_error(exc)
    param = _RENAMED.get(error.param or "", error.param)
    message = error.message
    for chat_field, ours in _RENAMED_IN_TEXT.items():  # "max_tokens must be ..." names this API's field
        if message.startswith(chat_field):
            message = ours + message[len(chat_field):]
            break
    return RequestError(message, error.status, param, error.code, error.headers)


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's fields a Response repeats, with OpenAI's defaults."""
    return {
        "instructions": req.instructions, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
        "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "store": req.store is not False,
        "text": req.text or {"format": {"type": "text"}}, "metadata": req.metadata or {},
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None}, "truncation": "disabled",
        "user": req.user,
    }


def _as_items(given: str | list[Any]) -> list[dict[str, Any]]:
    """This request's input as items with ids (what GET .../input_items lists)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    items = []
    for item in given:
        item = dict(item)
        item.setdefault("type", "message")
        item.setdefault("id", item_id("fc" if item["type"] == "function_call" else "msg"))
        items.append(item)
    return items
