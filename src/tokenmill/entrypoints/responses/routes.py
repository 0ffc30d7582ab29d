"""The Responses API's routes, registered on the app in one call (api_server.build_app)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from tokenmill.entrypoints.openai.chat_run import ChatRunner
from tokenmill.entrypoints.responses.protocol import ResponsesRequest
from tokenmill.entrypoints.responses.serving import ResponsesServing


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def install_responses(app: FastAPI, runner: Callable[[], ChatRunner], auth: list[Depends],
                      openapi_extra: dict | None = None) -> ResponsesServing:
    """`runner`: the chat handler (read per request: it picks its tool parser at start-up)."""
    serving = ResponsesServing()

    @app.post("/v1/responses", dependencies=auth, openapi_extra=openapi_extra)
    async def create_response(raw: Request) -> Response:
        return await serving.create(raw, runner(), bearer_token(raw))

    @app.get("/v1/responses/{response_id}", dependencies=auth)
    async def retrieve_response(response_id: str, raw: Request) -> Response:
        return serving.retrieve(response_id, bearer_token(raw))

    @app.delete("/v1/responses/{response_id}", dependencies=auth)
    async def delete_response(response_id: str, raw: Request) -> Response:
        return serving.delete(response_id, bearer_token(raw))

    @app.get("/v1/responses/{response_id}/input_items", dependencies=auth)
    async def response_input_items(response_id: str, raw: Request) -> Response:
        return serving.input_items(response_id, bearer_token(raw))

    return serving


__all__ = ["ResponsesRequest", "install_responses"]
