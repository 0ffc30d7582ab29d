"""The OpenAPI spec (/openapi.json, /docs, /redoc) with the real request models as request bodies.

Handlers read their body themselves (`parse_body`: strict JSON, the body-size limit, errors in
OpenAI's format), so FastAPI cannot see the models; each route declares its model with
`body_doc(Model)` and `install_openapi` puts the models' JSON schemas into the spec's components.
"""

from __future__ import annotations

from typing import Any

import pydantic
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


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
            spec.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
