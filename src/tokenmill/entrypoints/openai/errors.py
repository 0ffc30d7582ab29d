"""Every failure a client can see, as an OpenAI error body: {"error": {message, type, param, code}}.

Bad input is a 400 naming the field (404 for an unknown model); nothing a client sends may produce a
500. A 500 here means a bug in the server, and is logged with its traceback. Under /api/ (Ollama's
routes) the same failures come as Ollama's `{"error": "..."}`: its clients read no other shape, and
an error raised outside a route's own handling (the key check, a bug) must not switch protocol.
"""

from __future__ import annotations

import logging
import re

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import InvalidRequest
from tokenmill.frontend.tokenizer_manager import RequestError

logger = logging.getLogger(__name__)

_JSON_POSITION = re.compile(r"at line (\d+) column (\d+)")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "param": param, "code": code}}


def error_response(message: str, status: int, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def as_request_error(exc: BaseException) -> RequestError:
    """The client-facing form of an exception raised while serving a request."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, InvalidRequest):
        return RequestError(exc.message, 400, exc.param)
    if isinstance(exc, pydantic.ValidationError):
        message, param = validation_message(exc.errors())
        return RequestError(message, 400, param)
    logger.error("internal error while serving a request", exc_info=exc)
    # The exception's text describes our code, not the request: it stays in the log.
    return RequestError("internal server error; the server log has the details", 500)


def validation_message(errors: list) -> tuple[str, str | None]:
    """One readable line for pydantic's first error, and the top-level field it concerns."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return _json_message(str(first.get("msg", ""))), None
    # Union members appear in loc as type names ("str", "list[int]"): keep only real field names.
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",) and not _is_type_tag(p)]
    if not loc:
        return f"request body: {first.get('msg')}", None
    field = ".".join(loc)
    return f"{field}: {first.get('msg')} (got {_short(first.get('input'))})", loc[0]


def _json_message(msg: str) -> str:
    where = _JSON_POSITION.search(msg)
    at = f" at line {where.group(1)} column {where.group(2)}" if where else ""
    if "surrogate" in msg or "hex escape" in msg:
        # JSON allows \ud800-\udfff only as a pair (one character beyond U+FFFF); alone it is no text.
        return (f"the request body is not valid JSON: the \\u escape{at} is incomplete or a lone UTF-16 "
                "surrogate (\\ud800-\\udfff must be followed by its pair)")
    if "unicode code point" in msg or "utf-8" in msg.lower():
        return f"the request body is not valid UTF-8{at}"
    return f"the request body is not valid JSON: {msg.removeprefix('Invalid JSON: ')}"


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def shaped_response(request: Request, message: str, status: int, param: str | None = None, code: str | None = None,
                    headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in the protocol of the route that failed: Ollama's under /api/, else OpenAI's."""
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    return error_response(message, status, param, code, headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return shaped_response(request, exc.message, exc.status, exc.param, exc.code, exc.headers)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> JSONResponse:
        return shaped_response(request, exc.message, 400, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return shaped_response(request, message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return shaped_response(request, str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = as_request_error(exc)
        return shaped_response(request, err.message, err.status, err.param, err.code)
