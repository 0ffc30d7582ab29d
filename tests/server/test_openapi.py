"""The OpenAPI spec (issue 15): /openapi.json lists the API with the real request models as request
bodies, and /docs serves FastAPI's Swagger page."""

from __future__ import annotations

import pytest

from tests.server.fake_server import client_of, fake_app


@pytest.fixture(scope="module")
def http():
    with client_of(fake_app()[0]) as client:
        yield client


def test_spec_lists_the_api_with_request_models(http):
    resp = http.get("/openapi.json")
    assert resp.status_code == 200
    spec = resp.json()
    paths = spec["paths"]
    for path, method in (("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/models", "get"),
                         ("/v1/models/{model_id}", "get"), ("/tokenize", "post"), ("/detokenize", "post"),
                         ("/health", "get"), ("/metrics", "get")):
        assert method in paths.get(path, {}), path
    schemas = spec["components"]["schemas"]
    for path, model, field in (("/v1/chat/completions", "ChatCompletionRequest", "messages"),
                               ("/v1/completions", "CompletionRequest", "prompt"),
                               ("/tokenize", "TokenizeRequest", "prompt"),
                               ("/detokenize", "DetokenizeRequest", "tokens")):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert field in schemas[model]["properties"]
    assert "StreamOptions" in schemas  # nested models resolve too


def test_docs_page(http):
    resp = http.get("/docs")
    assert resp.status_code == 200 and "swagger" in resp.text.lower()
