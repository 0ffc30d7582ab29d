"""The OpenAPI spec (/openapi.json, /docs, /redoc) with the real request models as request bodies.

Handlers read their body themselves (`parse_body`: strict JSON, the body-size limit, errors in
OpenAI's format), so FastAPI cannot see the models; each route declares its model with
`body_doc(Model)` and `install_openapi` puts the models' JSON schemas into the spec's components.
Responses are documented the same way (protocol_responses.py): the JSON answer of each route, the
event stream of a streamed completion, and OpenAI's error format as every route's `default` (FastAPI's
own 422 schema is dropped: a validation error here is a 400 in OpenAI's format).
"""

from __future__ import annotations

from typing import Any

import pydantic
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from tokenmill.entrypoints.openai.protocol_responses import RESPONSE_MODELS

_REF = "#/components/schemas/{model}"
# Server-sent events: each event's `data` is one JSON chunk (the OpenAI chunk object), or [DONE].
_STREAM = {"text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}}}
# (method, path) -> the 200 answer: a model name, or the content map itself.
_OK: dict[tuple[str, str], str | dict[str, Any]] = {
    ("get", "/health"): {},  # no body (JSON with replica counts under data parallelism)
    ("get", "/metrics"): {"text/plain": {"schema": {"type": "string"}}},
    ("get", "/v1/models"): "ModelList",
    ("get", "/v1/models/{model_id}"): "ModelCard",
    ("get", "/v1/requests/{request_id}/timeline"): "RequestTimeline",
    ("post", "/v1/chat/completions"): "ChatCompletionResponse",
    ("post", "/v1/completions"): "CompletionResponse",
    ("post", "/tokenize"): "TokenizeResponse",
    ("post", "/detokenize"): "DetokenizeResponse",
    ("get", "/v1/dashboard/stream"): _STREAM,
    ("post", "/v1/responses"): "ResponseObject",
    ("get", "/v1/responses/{response_id}"): "ResponseObject",
    ("delete", "/v1/responses/{response_id}"): "ResponseDeleted",
    ("get", "/v1/responses/{response_id}/input_items"): "ResponseItemList",
    ("post", "/v1/messages"): "AnthropicMessage",
    ("post", "/v1/messages/count_tokens"): "AnthropicTokenCount",
}
_STREAMED = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
# Paths whose errors are not in OpenAI's format (and Ollama's /api/*: {"error": message}).
_ERRORS = {"/v1/messages": "AnthropicError", "/v1/messages/count_tokens": "AnthropicError"}


def body_doc(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI, models: list[type[pydantic.BaseModel]]) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                               description=app.description)
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
            _, out = models_json_schema([(m, "serialization") for m in RESPONSE_MODELS], ref_template=_REF)
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(defs.get("$defs", {}))
            schemas.update(out.get("$defs", {}))
            document_responses(spec)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _json(model: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(model=model)}}}


def document_responses(spec: dict[str, Any]) -> None:
    """Each operation's 200 answer (where known) and OpenAI's error format for every other status."""
    for path, operations in spec.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            ok = _OK.get((method, path))
            if ok is not None:
                content = _json(ok) if isinstance(ok, str) else dict(ok)
                if path in _STREAMED:
                    content.update(_STREAM)
                responses["200"] = {"description": "OK", **({"content": content} if content else {})}
            error = _ERRORS.get(path, "OllamaError" if path.startswith("/api/") else "ErrorResponse")
            shape = {"AnthropicError": "Anthropic's", "OllamaError": "Ollama's"}.get(error, "OpenAI's")
            responses["default"] = {"description": f"An error in {shape} format", "content": _json(error)}
    schemas = spec.get("components", {}).get("schemas", {})
    if "HTTPValidationError" not in str(spec.get("paths")):  # only the dropped 422s used them
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
