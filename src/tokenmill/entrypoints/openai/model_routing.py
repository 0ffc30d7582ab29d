"""The HTTP side of several models behind one server: a request's `model` picks the model.

ModelRoutingMiddleware reads the body of each generation route once (the app reads it again from
the copy handed on), finds the model it names (model_pool.py loads it if needed; an unknown name is
a 404 in the route's protocol: OpenAI's `model_not_found`, Ollama's and Anthropic's shapes), and
runs the route with that model's ServerState as the current one. The routes themselves are the
single-model routes, unchanged: they reach `server.chat`, `server.manager`, ... through RoutedState,
which answers with the current request's model. The request counts as in flight until its response
has been sent (a stream's last byte included), so its model cannot be unloaded under it.

A request its route would refuse before looking at the model loads nothing: a body that is not a
JSON object, or a `model` that is not a string, is answered 400 here. Ollama's `NAME:latest` means
NAME on every route (the body handed on names NAME, so an OpenAI route serves it rather than loading
the model and answering 404).

The routes that speak of every model (/health, /v1/models, /metrics, timelines, /api/tags, /api/ps,
/api/show) are registered here ahead of their single-model versions, which they shadow; they read
a model's files (model/model_facts.py), never load it.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import json
import logging
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.anthropic.serving import error_json
from tokenmill.entrypoints.ollama.replies import ModelCard, load_wait_s
from tokenmill.entrypoints.ollama.routes import body_object, ollama_error, read_body
from tokenmill.entrypoints.openai.errors import as_request_error, error_body
from tokenmill.entrypoints.openai.model_metrics import render_models
from tokenmill.entrypoints.openai.model_pool import ModelPool
from tokenmill.entrypoints.openai.server_state import ServerState
from tokenmill.entrypoints.openai.serving_common import now_s
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.model_router import ModelEntry, ModelState, keep_alive_seconds
from tokenmill.frontend.request_error import RequestError
from tokenmill.frontend.request_timelines import MAX_FINISHED
from tokenmill.frontend.server_status import ServerStatus
from tokenmill.model.model_facts import model_facts

logger = logging.getLogger(__name__)

# The state of the model the request being served was routed to.
current_state: contextvars.ContextVar[ServerState | None] = contextvars.ContextVar("current_state", default=None)

# POST routes whose body names a model. Others (GET /v1/responses/{id}, ...) need none.
ROUTED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/detokenize", "/v1/responses",
    "/v1/messages", "/v1/messages/count_tokens",
    "/api/chat", "/api/generate", "/api/embed", "/api/embeddings",
})

# GET routes of the live view: `?model=NAME` shows that model (loaded ones only: a look never loads
# one, and never holds it in flight); without it, the most recently used one.
DASHBOARD_PATHS = frozenset({"/v1/dashboard/stream", "/v1/dashboard/snapshot"})


class RoutedState:
    """Stands in for the one ServerState the single-model routes were written against."""

    def __init__(self, pool: ModelPool) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current(), name)

    def current(self) -> ServerState:
        state = current_state.get()
        if state is not None:
            return state
        # Outside a routed request (the dashboard): the most recently used loaded model.
        loaded = [e for e in self._pool.router.entries.values() if e.state is ModelState.LOADED]
        if not loaded:
            raise RequestError("no model is loaded yet: a request naming a model loads it", 503, code="no_model_loaded")
        return self._pool.engines[max(loaded, key=lambda e: e.last_used).name].state


class PoolDrain:
    """What DrainingServer reaches as `app.state.server.manager` with several models: drains them all."""

    def __init__(self, pool: ModelPool) -> None:
        self.manager = self
        self._pool = pool

    async def drain(self, timeout: float) -> int:
        return await self._pool.drain(timeout)


def _error(path: str, error: RequestError) -> tuple[dict[str, Any], int]:
    if path.startswith("/api/"):
        return {"error": error.message}, error.status
    if path.startswith("/v1/messages"):
        body, status, _ = error_json(error)
        return body, status
    return error_body(error.message, error.status, error.param, error.code), error.status


def unknown_model(name: str, names: list[str], path: str) -> RequestError:
    served = ", ".join(repr(n) for n in names)
    if path.startswith("/api/"):
        return RequestError(f"model '{name}' not found", 404)
    return RequestError(f"the model {name!r} does not exist; this server serves {served}", 404, "model",
                        "model_not_found")


class ModelRoutingMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware): a stream passes through untouched, and the request stays
    in flight until the inner app has sent the response's last byte."""

    def __init__(self, app: ASGIApp, pool: ModelPool, api_key: str | None) -> None:
        self.app = app
        self.pool = pool
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in DASHBOARD_PATHS:
            await self._dashboard(scope, receive, send)
            return
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTED_PATHS:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if not self._authorized(scope):  # the route's own check answers 401 in its shape; load nothing
            await self.app(scope, replay, send)
            return
        path = scope["path"]
        tic = time.monotonic()
        try:
            entry, keep_alive, body = self._choose(path, body)
            state = await self.pool.acquire(entry)
        except Exception as exc:  # unknown model, a failed load (503), a bug (500, logged)
            error = as_request_error(exc)
        else:
            error = None
        if error is not None:
            payload, status = _error(path, error)
            await JSONResponse(payload, status_code=status, headers=error.headers)(scope, replay, send)
            return
        token, waited = current_state.set(state), load_wait_s.set(time.monotonic() - tic)
        try:
            await self.app(scope, replay, send)
        finally:
            current_state.reset(token)
            load_wait_s.reset(waited)
            self.pool.release(entry, keep_alive)

    async def _dashboard(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model", [None])[0]
        if name is None or not self._authorized(scope):  # the route's own check answers 401
            await self.app(scope, receive, send)
            return
        entry = self.pool.router.find(name)
        if entry is None:
            error = unknown_model(name, list(self.pool.router.entries), scope["path"])
        elif entry.state is not ModelState.LOADED:
            error = RequestError(f"the model {name!r} is not loaded: the dashboard shows loaded models only "
                                 "(a request naming it loads it)", 503, "model", "model_not_loaded")
        else:
            token = current_state.set(self.pool.engines[entry.name].state)
            try:
                await self.app(scope, receive, send)
            finally:
                current_state.reset(token)
            return
        payload, status = _error(scope["path"], error)
        await JSONResponse(payload, status_code=status)(scope, receive, send)

    def _choose(self, path: str, body: bytes) -> tuple[ModelEntry, float | None, bytes]:
        """The model, the request's keep_alive, and the body to hand on (naming the model as served)."""
        fields = body_object(body)  # not a JSON object: 400 here, in Ollama's routes' words (no model loads)
        name = fields.get("model")
        if name is not None and not isinstance(name, str):  # the route's 400, before anything loads
            raise RequestError(f"model must be a string, got {type(name).__name__}", 400, "model")
        router = self.pool.router
        entry = router.find(name)
        if entry is None:
            raise unknown_model(str(name), list(router.entries), path)
        try:
            keep_alive = keep_alive_seconds(fields.get("keep_alive")) if path.startswith("/api/") else None
        except ValueError as exc:
            raise RequestError(str(exc), 400, "keep_alive") from None
        if name and name != entry.name and not path.startswith("/api/"):
            # `gemma:latest` on an OpenAI or Anthropic route: the route checks the name it serves.
            body = json.dumps({**fields, "model": entry.name}).encode()
        return entry, keep_alive, body

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        scheme, _, token = headers.get("authorization", "").partition(" ")
        presented = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "").strip()
        return secrets.compare_digest(presented, self.api_key)


def pool_lifespan(pool: ModelPool, host: str, port: int) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan with several models: nothing loads at start; every engine stops at the end."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool.start()
        names = ", ".join(pool.router.entries)
        print(f"tokenmill: serving {names} (each loaded on its first request) on http://{host}:{port}",
              file=sys.stderr, flush=True)
        try:
            yield
        finally:
            await pool.close()
            pool.ctx.destroy(linger=0)
            logger.info("shut down: every model's processes have exited")

    return lifespan


def install_model_routes(app: FastAPI, pool: ModelPool, auth: list[Any]) -> None:
    """The every-model routes; call before the single-model routes exist, which they shadow."""
    router = pool.router

    def engine_state(entry: ModelEntry) -> ServerState | None:
        engine = pool.engines.get(entry.name)
        return engine.state if engine is not None and entry.state is ModelState.LOADED else None

    @app.get("/health")
    async def health() -> Response:
        if pool.draining:
            return JSONResponse(error_body("the server is shutting down", 503), status_code=503)
        models = {}
        for entry in router.entries.values():
            state = engine_state(entry)
            unhealthy = state is not None and state.manager.status is ServerStatus.UNHEALTHY
            models[entry.name] = "unhealthy" if unhealthy else entry.state.value
        ok = all(v != "unhealthy" for v in models.values())
        # The API process serves (and loads on demand) whatever the loaded models' state: 200 either way.
        return JSONResponse({"status": "ok" if ok else "degraded", "models": models})

    def card(entry: ModelEntry) -> dict[str, Any]:
        state = engine_state(entry)
        limits = state.manager.limits if state is not None else None
        return {"id": entry.name, "object": "model", "created": now_s(), "owned_by": "tokenmill",
                "root": entry.path, "max_model_len": limits.max_model_len if limits else None,
                "status": entry.state.value, "loaded": entry.state is ModelState.LOADED,
                "in_flight": entry.in_flight, "loads": entry.loads, "load_seconds": entry.load_seconds,
                "memory_bytes": entry.memory_bytes}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card(e) for e in router.entries.values()]})

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def retrieve_model(model_id: str) -> JSONResponse:
        entry = router.find(model_id)
        if entry is None:
            raise unknown_model(model_id, list(router.entries), "/v1/models")
        return JSONResponse(card(entry))

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        loaded = {e.name: s.metrics for e in router.entries.values() if (s := engine_state(e)) is not None}
        return Response(render_models(loaded, router), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/requests/{request_id}/timeline", dependencies=auth)
    async def request_timeline(request_id: str) -> JSONResponse:
        for entry in router.entries.values():
            state = engine_state(entry)
            found = state.manager.timeline(request_id) if state is not None else None
            if found is not None:
                return JSONResponse({"id": request_id, "model": entry.name,
                                     "sequences": [{**seq, "model": entry.name} for seq in found]})
        raise RequestError(f"no request {request_id!r} is running or among the last {MAX_FINISHED} finished "
                           "on a loaded model", 404, "request_id", "request_not_found")

    async def ollama_card(entry: ModelEntry) -> ModelCard:
        state = engine_state(entry)
        facts = await asyncio.to_thread(model_facts, entry.path)  # cached per file version after the first
        if state is not None and state.manager.limits is not None:
            context = state.manager.limits.max_model_len
        else:  # not loaded: what the files say, within --max-model-len
            context = min((c for c in (facts.context_length, pool.settings.engine.max_model_len) if c), default=0)
        return ModelCard(entry.name, entry.path, context, facts)

    @app.get("/api/tags", dependencies=auth)
    async def tags() -> JSONResponse:
        return JSONResponse({"models": [(await ollama_card(e)).tag() for e in router.entries.values()]})

    @app.get("/api/ps", dependencies=auth)
    async def ps() -> JSONResponse:
        running = []
        for entry in router.entries.values():
            if entry.state is ModelState.LOADED:
                running.append({**(await ollama_card(entry)).running(),
                                "expires_at": expires_at(entry, router.idle_unload_s), "size": entry.memory_bytes})
        return JSONResponse({"models": running})

    @app.post("/api/show", dependencies=auth)
    async def show(raw: Request) -> JSONResponse:
        """From the files (a loaded model's own tokenizer and parsers when it is loaded): showing a
        model never loads it, so never unloads another."""
        try:
            body = await read_body(raw)
            name = body.get("model") or body.get("name")
            if not isinstance(name, str):
                raise InvalidRequest("model is required: the name of the model to show", param="model")
            entry = router.find(name)
            if entry is None:
                raise unknown_model(name, list(router.entries), "/api/show")
            card, state = await ollama_card(entry), engine_state(entry)
            chat = state.chat if state is not None else pool.settings
            tokenizer = state.manager.tokenizer if state is not None else None
            template = getattr(tokenizer, "chat_template", None) or card.facts.chat_template or ""
            return JSONResponse(card.show(template, chat.tool_parser is not None, chat.reasoning_parser is not None))
        except Exception as exc:
            return ollama_error(exc)


FOREVER = "2318-08-13T00:00:00Z"  # what Ollama shows for a model kept loaded (keep_alive -1)


def expires_at(entry: ModelEntry, idle_unload_s: float | None) -> str:
    """When an idle model would unload, on the wall clock (Ollama's expires_at); far away: never."""
    if entry.in_flight or (entry.unload_at is None and idle_unload_s is None) or entry.unload_at == float("inf"):
        return FOREVER
    deadline = entry.unload_at if entry.unload_at is not None else entry.last_used + (idle_unload_s or 0.0)
    wall = time.time() + (deadline - time.monotonic())
    try:
        return datetime.datetime.fromtimestamp(wall, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    except (OverflowError, ValueError, OSError):  # past year 9999 or the platform's time_t: never, as far as a date goes
        return FOREVER


__all__ = ["PoolDrain", "RoutedState", "current_state", "install_model_routes"]
