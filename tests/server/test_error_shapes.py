"""Errors raised outside a route's own handling (the key check, a bug) come in the protocol of the
route: Ollama's `{"error": "..."}` under /api/, OpenAI's error object elsewhere
(entrypoints/openai/errors.py)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tokenmill.entrypoints.openai.errors import install_handlers
from tokenmill.frontend.request_error import RequestError


def test_ollama_routes_fail_in_ollama_shape_and_the_others_in_openai_shape():
    app = FastAPI()
    install_handlers(app)

    @app.get("/api/ps")
    @app.get("/v1/models")
    async def broken() -> None:
        raise OverflowError("timestamp out of range for platform time_t")

    @app.get("/api/tags")
    @app.get("/v1/files")
    async def locked() -> None:
        raise RequestError("invalid or missing API key", 401, code="invalid_api_key")

    client = TestClient(app, raise_server_exceptions=False)
    ps = client.get("/api/ps")
    assert ps.status_code == 500 and ps.json() == {"error": "internal server error; the server log has the details"}
    assert client.get("/api/tags").json() == {"error": "invalid or missing API key"}
    assert client.get("/api/nowhere").json() == {"error": "Not Found"}
    models = client.get("/v1/models")
    assert models.status_code == 500 and models.json()["error"]["type"] == "internal_server_error"
    assert client.get("/v1/files").json()["error"]["code"] == "invalid_api_key"
