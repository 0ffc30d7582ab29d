"""The Messages API's routes, registered on the app in one call (api_server.build_app).

Anthropic's clients send the key as `x-api-key` (Claude Code and the SDK with an auth token send
`Authorization: Bearer`): either is accepted. Every failure on these routes, the key check and body
errors included, is answered in Anthropic's error shape, which its SDKs parse.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from tokenmill.entrypoints.anthropic.serving import MessagesServing, error_json
from tokenmill.entrypoints.openai.chat_run import ChatRunner
from tokenmill.frontend.request_error import RequestError


def _presented_key(request: Request) -> str:
    key = request.headers.get("x-api-key")
    if key is not None:
        return key.strip()
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def install_messages(app: FastAPI, runner: Callable[[], ChatRunner], api_key: str | None,
                     docs: Callable[[type], dict]) -> MessagesServing:
    """`runner`: the chat handler (read per request: it picks its tool parser at start-up)."""
    serving = MessagesServing()

    async def answer(raw: Request, handle: Callable[[], Awaitable[Response]]) -> Response:
        try:
            if api_key is not None and not secrets.compare_digest(_presented_key(raw), api_key):
                raise RequestError("invalid or missing API key (send 'x-api-key: <key>')", 401)
            return await handle()
        except Exception as exc:
            body, status, headers = error_json(exc)
            return JSONResponse(body, status_code=status, headers=headers)

    @app.post("/v1/messages", openapi_extra=docs(MessagesRequest))
    async def create_message(raw: Request) -> Response:
        return await answer(raw, lambda: serving.create(raw, runner()))

    @app.post("/v1/messages/count_tokens", openapi_extra=docs(CountTokensRequest))
    async def count_message_tokens(raw: Request) -> Response:
        return await answer(raw, lambda: serving.count_tokens(raw, runner()))

    return serving


__all__ = ["CountTokensRequest", "MessagesRequest", "install_messages"]
