"""Around every HTTP request: the `x-request-id` response header and one access-log line at INFO.

The id is the client's own `x-request-id` when it sent a usable one (so its logs and ours join),
else the id the handler gave the request (`chatcmpl-...`, `cmpl-...`), else a fresh `req-...`. The
log line (logger `tokenmill.access`) is written when the response has been sent in full, so a stream's
line carries its final token counts: method, path, status, duration, prompt and completion tokens.

An exception that escapes a handler ends here as a 500 in OpenAI's format (its text stays in the
log): Starlette's own last-resort handler sits outside this middleware and would drop the header.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.openai.errors import as_request_error, error_response

logger = logging.getLogger("tokenmill.access")

HEADER = b"x-request-id"
_SCOPE_KEY = "tokenmill.request_record"
# A client's id is echoed into our headers and logs: only short, printable ones.
_MAX_CLIENT_ID = 128


@dataclass
class RequestRecord:
    """What the access log and the header need to know about one request; handlers fill it in."""

    client_id: str | None = None
    request_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    _fallback: str | None = None

    @property
    def response_id(self) -> str:
        if self._fallback is None and not (self.client_id or self.request_id):
            self._fallback = f"req-{uuid.uuid4().hex}"
        return self.client_id or self.request_id or self._fallback or ""

    def set_usage(self, usage: dict[str, Any]) -> None:
        self.prompt_tokens = usage.get("prompt_tokens")
        self.completion_tokens = usage.get("completion_tokens")


def record_of(request: Request) -> RequestRecord:
    """The request's record (a detached one where the middleware is not installed)."""
    record = request.scope.get(_SCOPE_KEY)
    if record is None:
        record = request.scope[_SCOPE_KEY] = RequestRecord()
    return record


def _client_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == HEADER:
            text = value.decode("latin-1").strip()
            if 0 < len(text) <= _MAX_CLIENT_ID and text.isprintable() and text.isascii():
                return text
            return None
    return None


class RequestLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = scope[_SCOPE_KEY] = RequestRecord(client_id=_client_id(scope))
        start = time.monotonic()
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, record.response_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if status is not None:  # the response is under way: nothing more can be said to the client
                raise
            error = as_request_error(exc)
            await error_response(error.message, error.status, error.param, error.code)(scope, receive, send_with_id)
        finally:
            _log(scope, record, status, time.monotonic() - start)


def _log(scope: Scope, record: RequestRecord, status: int | None, seconds: float) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    tokens = ""
    if record.prompt_tokens is not None:
        tokens += f" prompt_tokens={record.prompt_tokens}"
    if record.completion_tokens is not None:
        tokens += f" completion_tokens={record.completion_tokens}"
    logger.info("%s %s %s %.1f ms id=%s%s", scope.get("method", "?"), scope.get("path", "?"),
                status if status is not None else "-", seconds * 1000, record.response_id, tokens)
