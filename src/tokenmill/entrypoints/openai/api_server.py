"""`tokenmill serve`: the FastAPI app, its lifespan (children, handshake, shutdown) and uvicorn.

    client --HTTP/SSE--> main process (this app + TokenizerManager)
                           | AddRequest / AbortRequest (zmq PUSH)
                           v
                         scheduler process (EngineCore) --TokenBatch--> detokenizer process
                           ^                 FinishRequest (stop string) --'      | TextBatch
                           '----------- SchedulerReady / Stats / RequestFailed -> main <-'

The server listens at once (so /health can say 503 while the model loads); the children start in
the lifespan, and requests are served once the handshake and a real one-token request went through.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
import zmq.asyncio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.config import DataParallelConfig, EngineConfig
from tokenmill.entrypoints.anthropic.routes import CountTokensRequest, MessagesRequest, install_messages
from tokenmill.entrypoints.ollama.routes import install_ollama
from tokenmill.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimitMiddleware
from tokenmill.entrypoints.openai.dashboard import install_dashboard
from tokenmill.entrypoints.openai.errors import error_response, install_handlers
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.model_pool import ModelPool, PoolSettings
from tokenmill.entrypoints.openai.model_routing import (
    ModelRoutingMiddleware,
    PoolDrain,
    RoutedState,
    install_model_routes,
    pool_lifespan,
)
from tokenmill.entrypoints.openai.openapi import body_doc, install_openapi
from tokenmill.entrypoints.openai.processes import ChildProcesses
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.entrypoints.openai.replica_header import ReplicaHeaderMiddleware
from tokenmill.entrypoints.openai.request_log import RequestLogMiddleware
from tokenmill.entrypoints.openai.server_state import ServerState
from tokenmill.entrypoints.openai.serving_common import check_model, now_s
from tokenmill.entrypoints.responses.routes import ResponsesRequest, install_responses
from tokenmill.frontend.dp_router import DataParallelRouter
from tokenmill.frontend.live_bound import install_live_bound
from tokenmill.frontend.model_router import RouterConfig
from tokenmill.frontend.reasoning_parser import get_reasoning_parser
from tokenmill.frontend.request_timelines import MAX_FINISHED
from tokenmill.frontend.server_status import ServerStatus
from tokenmill.frontend.tokenize_pool import TokenizePool
from tokenmill.frontend.tokenizer_manager import RequestError, TokenizerManager
from tokenmill.frontend.tool_parsers import get_tool_parser
from tokenmill.ipc.channels import IpcPaths

logger = logging.getLogger(__name__)

# After the drain, connections still open get this long to close before uvicorn cuts them.
GRACEFUL_SHUTDOWN_S = 5
# How long running requests may take to finish after SIGTERM before they are aborted (--shutdown-timeout).
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    model_path: str = ""  # resolved path of the model (the tokenizer is loaded from it)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "WARNING"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    max_queued_requests: int | None = None  # None: sized from the KV pool (TokenizerManager.queued_bound)
    reasoning_parser: str | None = None  # --reasoning-parser: a name in frontend/reasoning_parser.py
    tool_call_parser: str | None = None  # --tool-call-parser: a name in frontend/tool_parsers.py
    # --data-parallel-size / --load-balance-method: replicas behind a router (frontend/dp_router.py)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    tokenizer_workers: int = 0  # --tokenizer-workers: processes for templates + tokenization (0: a thread)
    chat_template: str | None = None  # --chat-template's text: replaces the model's (or gives a base model one)
    models: RouterConfig | None = None  # several models behind a router (model_pool.py); None: one, as always


def build_app(
    config: ServerConfig, on_fatal: Callable[[], None] = lambda: None, state: ServerState | None = None
) -> FastAPI:
    """The app; with `state` given, its manager is used as it is and no child process starts."""
    # An unknown name fails here, before any child process starts.
    reasoning_parser = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
    tool_parser = get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None
    pool = None
    if config.models is not None and state is None:  # several models: a pool of engines, each on demand
        pool = ModelPool(zmq.asyncio.Context(), config.models.router(), PoolSettings(
            config.engine, config.log_level, config.max_queued_requests, config.chat_template, reasoning_parser,
            tool_parser))
    server = state or (RoutedState(pool) if pool is not None else ServerState())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        paths = IpcPaths.create()
        ctx = zmq.asyncio.Context()
        dp = config.data_parallel
        router = server.replicas = DataParallelRouter(
            ctx, paths, dp.size, dp.load_balance_method, config.engine.page_size) if dp.size > 1 else None
        metrics = ServerMetrics(lambda: server.manager.stats, lambda: server.manager.num_queued,
                                router.replica_stats if router else None)
        manager = TokenizerManager(ctx, paths, config.model_path, metrics, config.max_queued_requests,
                                   (router, router) if router else None, config.chat_template)
        server.attach(manager, metrics, reasoning_parser, tool_parser)
        children = ChildProcesses(paths, config.engine, config.served_model_name, config.log_level, dp)
        children.start()
        on_exit = server.manager.on_process_exit
        if router is not None:  # a replica's death is the router's business until none is left
            router.on_all_dead, on_exit = on_exit, router.on_process_exit
        watch = asyncio.create_task(children.watch(on_exit))
        startup = asyncio.create_task(_startup(server.manager, config, on_fatal, server.chat.choose_tool_parser))
        if config.tokenizer_workers:  # spawned from this (the event loop's) thread: see tokenize_pool.py
            manager.tokenize_pool = TokenizePool(config.tokenizer_workers, config.log_level)
            workers_up = asyncio.create_task(manager.tokenize_pool.start_with(manager))
        try:
            yield
        finally:
            startup.cancel()
            watch.cancel()
            await asyncio.gather(startup, watch, return_exceptions=True)
            await server.manager.shutdown()
            if router is not None:
                await router.close()
            if manager.tokenize_pool is not None:
                workers_up.cancel()
                await manager.tokenize_pool.close()
            await asyncio.to_thread(children.terminate)
            ctx.destroy(linger=0)
            paths.remove()
            logger.info("shut down: all child processes have exited")

    app = FastAPI(title="tokenmill", lifespan=None if state else pool_lifespan(pool, config.host, config.port)
                  if pool is not None else lifespan,
                  description="An OpenAI-compatible LLM inference server (plus vLLM's extra fields and endpoints).")
    app.state.server = PoolDrain(pool) if pool is not None else server  # run_server drains it on SIGTERM
    install_handlers(app)
    install_openapi(app, [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest,
                          ResponsesRequest, MessagesRequest, CountTokensRequest])
    if pool is not None:  # innermost: it reads bodies the size limit has already bounded
        app.add_middleware(ModelRoutingMiddleware, pool=pool, api_key=config.api_key)
    # Outermost last: the log sees every response, the 413s included.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.data_parallel.size > 1:
        app.add_middleware(ReplicaHeaderMiddleware)
    app.add_middleware(RequestLogMiddleware)

    async def check_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), config.api_key):
            raise RequestError("invalid or missing API key (send 'Authorization: Bearer <key>')", 401,
                               code="invalid_api_key")

    auth = [Depends(check_api_key)]
    if pool is not None:  # /health, /v1/models, /metrics, ... over every model, ahead of the ones below
        install_model_routes(app, pool, auth)

    @app.get("/health")
    async def health() -> Response:
        manager = server.manager
        if manager.draining:
            return error_response("the server is shutting down", 503)
        if await manager.health():
            if server.replicas is None:
                return Response(status_code=200)
            # Degraded, not down: requests still succeed while one replica serves.
            live, total = server.replicas.num_live, server.replicas.size
            return JSONResponse({"status": "ok" if live == total else "degraded",
                                 "replicas_live": live, "replicas_total": total})
        reason = {
            ServerStatus.STARTING: "the server is starting",
            ServerStatus.UNHEALTHY: f"the server is unhealthy: {manager.unhealthy_reason}",
            ServerStatus.UP: "a one-token request did not come back in time",
        }[manager.status]
        return error_response(reason, 503)

    def model_card() -> dict:
        server.manager.check_ready()
        limits = server.manager.limits
        assert limits is not None
        return {"id": limits.model_name, "object": "model", "created": now_s(), "owned_by": "tokenmill",
                "root": config.model_path, "max_model_len": limits.max_model_len}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def retrieve_model(model_id: str) -> JSONResponse:
        card = model_card()
        check_model(model_id, card["id"])
        return JSONResponse(card)

    @app.get("/v1/requests/{request_id}/timeline", dependencies=auth)
    async def request_timeline(request_id: str) -> JSONResponse:
        found = server.manager.timeline(request_id)
        if found is None:
            raise RequestError(f"no request {request_id!r} is running or among the last {MAX_FINISHED} finished",
                               404, "request_id", "request_not_found")
        if server.replicas is not None:
            found = [{**seq, "replica": server.replicas.replica_of(seq["id"])} for seq in found]
        return JSONResponse({"id": request_id, "sequences": found})

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions", dependencies=auth, openapi_extra=body_doc(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        return await server.chat.create(raw)

    @app.post("/v1/completions", dependencies=auth, openapi_extra=body_doc(CompletionRequest))
    async def completions(raw: Request) -> Response:
        return await server.completion.create(raw)

    @app.post("/v1/embeddings", dependencies=auth)
    async def embeddings(raw: Request) -> Response:
        return await server.embeddings.create(raw)

    @app.post("/tokenize", dependencies=auth, openapi_extra=body_doc(TokenizeRequest))
    async def tokenize(raw: Request) -> Response:
        return await server.tokens.tokenize(raw)

    @app.post("/detokenize", dependencies=auth, openapi_extra=body_doc(DetokenizeRequest))
    async def detokenize(raw: Request) -> Response:
        return await server.tokens.detokenize(raw)

    # The other protocols: translators onto the chat path (server.chat), each registered in one call.
    install_responses(app, lambda: server.chat, auth, body_doc(ResponsesRequest))
    install_messages(app, lambda: server.chat, config.api_key, body_doc)
    install_dashboard(app, lambda: server.manager, config.api_key, lambda: server.replicas)  # dashboard.py
    install_ollama(app, lambda: server, config.model_path, auth, multi_model=pool is not None)  # Ollama's /api/*
    return app


async def _startup(manager: TokenizerManager, config: ServerConfig, on_fatal: Callable[[], None],
                   on_ready: Callable[[], None] = lambda: None) -> None:
    if await manager.start() and install_live_bound(manager, config.engine.max_num_seqs):
        assert manager.limits is not None
        on_ready()  # e.g. the tool-call parser read from the chat template, logged once
        print(f"tokenmill: serving {manager.limits.model_name} on http://{config.host}:{config.port}",
              file=sys.stderr, flush=True)
        return
    logger.error("start-up failed (%s); shutting down", manager.unhealthy_reason)
    on_fatal()


def run_server(config: ServerConfig) -> int:
    """Serves until SIGINT/SIGTERM; returns the exit code (1 if start-up failed)."""
    exit_code = 0
    uv_server: uvicorn.Server | None = None

    def on_fatal() -> None:
        nonlocal exit_code
        exit_code = 1
        if uv_server is not None:
            uv_server.should_exit = True

    app = build_app(config, on_fatal)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, loop="asyncio", log_level=config.log_level.lower(),
        # RequestLogMiddleware writes the access log (with token counts); uvicorn's would repeat it.
        access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    uv_server = DrainingServer(uv_config, lambda: app.state.server, config.shutdown_timeout)
    uv_server.run()
    if not uv_server.started and exit_code == 0:
        exit_code = 1  # e.g. the port is taken: uvicorn logged why
    return exit_code


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM or SIGINT drains before it stops: new requests get 503 while
    the running ones have `shutdown_timeout` seconds to finish, the rest end with a final "abort"
    chunk, an error event and [DONE] (TokenizerManager.drain); only then does uvicorn close the
    connections, and the process exits 0. A second signal stops at once, as plain uvicorn does."""

    def __init__(self, config: uvicorn.Config, state: Callable[[], ServerState], shutdown_timeout: float) -> None:
        super().__init__(config)
        self._state = state
        self._shutdown_timeout = shutdown_timeout
        self._drain: asyncio.Task | None = None  # held: the loop keeps only a weak reference to a task
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        manager = getattr(self._state(), "manager", None)
        if self._draining or manager is None or not self.started or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal, or nothing to drain yet
            return
        self._draining = True
        logger.warning("received signal %d: draining (up to %g s) before shutting down", sig, self._shutdown_timeout)
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._start_drain, manager)

    def _start_drain(self, manager: TokenizerManager) -> None:
        async def drain() -> None:
            await manager.drain(self._shutdown_timeout)
            await asyncio.sleep(0.2)  # the streams' last chunks reach their sockets
            self.should_exit = True

        self._drain = asyncio.ensure_future(drain())
