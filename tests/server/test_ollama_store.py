"""Ollama's model-store routes (pull, push, create, copy, delete) answer 501 in Ollama's shape, and say
where this server's models come from: the one it was started with, or, behind the model router,
--models-dir / --model (entrypoints/ollama/routes.py)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tokenmill.entrypoints.ollama.routes import install_ollama
from tokenmill.entrypoints.openai.errors import install_handlers


def store_replies(multi_model: bool) -> list[tuple[int, str]]:
    app = FastAPI()
    install_handlers(app)
    install_ollama(app, lambda: None, "/m/a.gguf", [], multi_model=multi_model)
    client = TestClient(app)
    replies = [client.post(f"/api/{name}", json={}) for name in ("pull", "push", "create", "copy")]
    replies.append(client.delete("/api/delete"))
    return [(r.status_code, r.json()["error"]) for r in replies]


def test_the_store_routes_say_where_the_models_come_from():
    for status, message in store_replies(multi_model=True):
        assert status == 501 and "--models-dir or named with --model" in message and "started with" not in message
    for status, message in store_replies(multi_model=False):
        assert status == 501 and "serves the model it was started with" in message
