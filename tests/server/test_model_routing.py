"""The model router's HTTP side (entrypoints/openai/model_routing.py) over a fake pool: no model
loads, so what a request makes the pool do is checked in milliseconds: a request its route refuses
loads nothing, an Ollama tag on an OpenAI route is served by its model, /api/show and /api/tags
describe a model from its files without loading it, and /api/ps's expires_at never fails, whatever
keep_alive asked for."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.ollama.routes import body_object
from tokenmill.entrypoints.openai.errors import install_handlers
from tokenmill.entrypoints.openai.model_pool import PoolSettings
from tokenmill.entrypoints.openai.model_routing import (
    FOREVER,
    ModelRoutingMiddleware,
    current_state,
    expires_at,
    install_model_routes,
)
from tokenmill.frontend.model_router import ModelEntry, ModelRouter, ModelState, keep_alive_seconds


def test_expires_at_shows_a_date_or_forever_and_never_fails():
    entry = ModelEntry("a", "/m/a", ModelState.LOADED)
    router = ModelRouter([entry], idle_unload_s=None)
    router.started(entry, time.monotonic())
    assert expires_at(entry, None) == FOREVER  # busy
    router.finished(entry, time.monotonic(), keep_alive_seconds("1h"))
    soon = expires_at(entry, None)
    assert soon.endswith("Z") and soon != FOREVER and soon[:4].isdigit()
    for huge in (1e12, 1e308, "1e12"):  # too far for any clock: forever, as a negative keep_alive
        router.started(entry, time.monotonic())
        router.finished(entry, time.monotonic(), keep_alive_seconds(huge))
        assert expires_at(entry, None) == FOREVER
    entry.unload_at = time.monotonic() + 1e12  # a deadline no date can show (year 33715): forever, not a 500
    assert expires_at(entry, None) == FOREVER
    entry.unload_at = None
    assert expires_at(entry, 1e15) == FOREVER  # --idle-unload-seconds as large


class FakePool:
    """What the middleware and the every-model routes reach: the router, and acquire() recorded."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router
        self.acquired: list[str] = []
        self.engines: dict = {}
        self.draining = False
        self.settings = PoolSettings(EngineConfig(), tool_parser=None, reasoning_parser=None)

    async def acquire(self, entry: ModelEntry) -> SimpleNamespace:
        self.acquired.append(entry.name)
        return SimpleNamespace(name=entry.name)

    def release(self, entry: ModelEntry, keep_alive: float | None = None) -> None:
        pass


async def echo(scope, receive, send) -> None:
    """The route: what body it was handed, and which model's state it runs with."""
    body = (await receive())["body"]
    await JSONResponse({"body": json.loads(body), "model": current_state.get().name})(scope, receive, send)


def post(pool: FakePool, path: str, body: dict) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=ModelRoutingMiddleware(echo, pool, None))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)
    return asyncio.run(main())


def two_models() -> FakePool:
    return FakePool(ModelRouter([ModelEntry("a", "/m/a"), ModelEntry("gemma", "/m/gemma")]))


def test_a_model_that_is_not_a_string_is_refused_before_anything_loads():
    pool = two_models()
    reply = post(pool, "/v1/completions", {"model": 123, "prompt": "hi"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"
    assert "model must be a string" in reply.json()["error"]["message"]
    ollama = post(pool, "/api/chat", {"model": ["a"], "messages": []})
    assert ollama.status_code == 400 and ollama.json() == {"error": "model must be a string, got list"}
    anthropic = post(pool, "/v1/messages", {"model": {"x": 1}, "max_tokens": 1, "messages": []})
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    assert pool.acquired == []  # not the default model, nor any other
    assert post(pool, "/v1/completions", {"prompt": "hi"}).json()["model"] == "a"  # none named: the default


def post_raw(pool: FakePool, path: str, content: bytes) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=ModelRoutingMiddleware(echo, pool, None))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, content=content, headers={"content-type": "application/json"})
    return asyncio.run(main())


def test_a_body_that_is_not_a_json_object_is_refused_before_anything_loads():
    pool = two_models()
    for content, words in ((b'{"model": "a", "prompt": ', "not valid JSON"), (b"\xff\xfe", "not valid JSON"),
                           (b'["a"]', "must be a JSON object"), (b'"a"', "must be a JSON object")):
        reply = post_raw(pool, "/v1/completions", content)
        assert reply.status_code == 400 and words in reply.json()["error"]["message"], content
        ollama = post_raw(pool, "/api/generate", content)
        assert ollama.status_code == 400 and words in ollama.json()["error"], content
        anthropic = post_raw(pool, "/v1/messages", content)
        assert anthropic.status_code == 400 and anthropic.json()["type"] == "error", content
    assert pool.acquired == []  # the default model did not load to say so
    assert body_object(b"") == {}  # an empty body is Ollama's {}: the default model, not a 400


def test_an_ollama_tag_on_an_openai_route_is_served_by_that_model():
    pool = two_models()
    reply = post(pool, "/v1/completions", {"model": "gemma:latest", "prompt": "hi", "max_tokens": 1.5})
    assert reply.json() == {"body": {"model": "gemma", "prompt": "hi", "max_tokens": 1.5}, "model": "gemma"}
    assert post(pool, "/v1/chat/completions", {"model": "gemma", "messages": []}).json()["body"]["model"] == "gemma"
    ollama = post(pool, "/api/generate", {"model": "gemma:latest", "prompt": "hi"})  # Ollama's routes take the tag
    assert ollama.json() == {"body": {"model": "gemma:latest", "prompt": "hi"}, "model": "gemma"}
    assert pool.acquired == ["gemma"] * 3


def gemma_gguf(path: Path) -> str:
    """A GGUF holding metadata only, as a Gemma-3 file states it."""
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(32768)
    w.add_tokenizer_model("llama")
    w.add_token_list(["a", "b"])
    w.add_chat_template("{{ messages }}<start_of_turn>")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_tags_and_show_read_the_files_and_load_nothing(tmp_path):
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 4096}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ qwen }}"}))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF")
    router = ModelRouter([ModelEntry("g", gemma_gguf(tmp_path / "g.gguf")), ModelEntry("q", str(folder)),
                          ModelEntry("broken", str(broken))])
    pool = FakePool(router)
    pool.settings = PoolSettings(EngineConfig(max_model_len=8192), tool_parser=object())
    app = FastAPI()
    install_handlers(app)
    install_model_routes(app, pool, [])
    client = TestClient(app)
    families = {m["name"]: m["details"]["family"] for m in client.get("/api/tags").json()["models"]}
    assert families == {"g:latest": "gemma3", "q:latest": "qwen2", "broken:latest": ""}
    shown = client.post("/api/show", json={"name": "g:latest"}).json()
    assert shown["model_info"] == {"general.architecture": "gemma3", "gemma3.context_length": 8192}  # --max-model-len
    assert shown["template"] == "{{ messages }}<start_of_turn>" and shown["details"]["families"] == ["gemma3"]
    assert shown["capabilities"] == ["completion", "embedding", "tools"]
    qwen = client.post("/api/show", json={"model": "q"}).json()
    assert qwen["model_info"] == {"general.architecture": "qwen2", "qwen2.context_length": 4096}
    assert qwen["template"] == "{{ qwen }}"
    missing = client.post("/api/show", json={"model": "nope"})
    assert missing.status_code == 404 and missing.json() == {"error": "model 'nope' not found"}
    assert client.post("/api/show", json={}).json() == {"error": "model is required: the name of the model to show"}
    assert pool.acquired == [] and all(e.state is ModelState.UNLOADED for e in router.entries.values())
