"""GET /dashboard: the server's live view of its scheduler, served by the server itself.

    GET /dashboard               the page (static/dashboard.html; no build step, nothing from a CDN)
    GET /dashboard/dashboard.js  its script (static code, no data: served without the key)
    GET /v1/dashboard/stream     server-sent events, one snapshot (dashboard_feed.py) per tick
    GET /v1/dashboard/snapshot   the same snapshot once, as JSON (scripts, tests)

With `--api-key`, the page, the stream and the snapshot need the key, as the API does; a browser
cannot send a header when it loads a page or opens an EventSource, so `?api_key=KEY` in the URL is
accepted too (open `/dashboard?api_key=KEY`; the page passes it on to its stream, and sends it as a
Bearer header when it fetches a request's timeline). The access log records paths without query
strings, so the key does not reach the log; it does reach the browser's history.

The page reads only what the API process already holds (the scheduler's pushed stats, its own
latency window), at a fixed cadence shared by every open page, so watching cannot slow the engine.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.openai.dashboard_feed import DEFAULT_INTERVAL_S, DashboardFeed
from tokenmill.frontend.tokenizer_manager import RequestError

# Each open page holds one stream; past this many, new ones get 429 (a bound on the API process's
# work, whatever a client does).
MAX_STREAMS = 16
# Nothing on the page may come from elsewhere (no CDN, no font, no beacon): the browser enforces it.
CSP = ("default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _static(name: str) -> bytes:
    # Read on each load (a page is opened rarely; ~20 kB): an edited file shows without a restart.
    return resources.files("tokenmill.entrypoints.openai").joinpath("static", name).read_bytes()


def dashboard_auth(api_key: str | None) -> Callable[[Request], Any]:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.query_params.get("api_key", "")
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise RequestError("invalid or missing API key: open the dashboard as /dashboard?api_key=<key> "
                               "(or send 'Authorization: Bearer <key>')", 401, "api_key", "invalid_api_key")
    return check


class FeedsByModel:
    """One DashboardFeed per model: behind the model router `manager()` answers the model the request
    names (`?model=`) or the most recently used one, and each model keeps its own tick cache and its
    own previous stats for the rates (mixing two models' counters would make nonsense deltas). With
    one model this is the one feed."""

    MAX_FEEDS = 16  # models loaded and unloaded over a server's life; the oldest feed goes first

    def __init__(self, manager: Callable[[], Any], replicas: Callable[[], Any] = lambda: None,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.manager = manager
        self.replicas = replicas
        self.interval_s = interval_s
        self._feeds: dict[int, tuple[Any, DashboardFeed]] = {}  # id(manager) -> (manager, its feed)

    def current(self) -> DashboardFeed:
        manager = self.manager()
        held = self._feeds.get(id(manager))
        if held is None or held[0] is not manager:
            if len(self._feeds) >= self.MAX_FEEDS:
                self._feeds.pop(next(iter(self._feeds)))
            held = self._feeds[id(manager)] = (manager, DashboardFeed(lambda: manager, self.interval_s,
                                                                        replicas=self.replicas))
        return held[1]


class DashboardStreams:
    """The SSE side: counts open streams and ends them when the server drains."""

    def __init__(self, feeds: FeedsByModel) -> None:
        self.feeds = feeds
        self.open = 0

    async def events(self) -> AsyncIterator[str]:
        self.open += 1
        try:
            yield "retry: 2000\n\n"  # reconnect after 2 s if the connection drops
            while not getattr((feed := self.feeds.current()).manager(), "draining", False):
                yield f"data: {json.dumps(feed.snapshot())}\n\n"
                await asyncio.sleep(feed.interval_s)
            yield "event: end\ndata: {\"reason\": \"the server is shutting down\"}\n\n"
        finally:
            self.open -= 1


def install_dashboard(app: FastAPI, manager: Callable[[], Any], api_key: str | None,
                      replicas: Callable[[], Any] = lambda: None) -> FeedsByModel:
    feeds = FeedsByModel(manager, replicas)
    streams = DashboardStreams(feeds)
    auth = [Depends(dashboard_auth(api_key))]

    @app.get("/dashboard", dependencies=auth, include_in_schema=False)
    async def dashboard_page() -> Response:
        return HTMLResponse(_static("dashboard.html"), headers={"Content-Security-Policy": CSP,
                                                                 "Cache-Control": "no-store"})

    @app.get("/dashboard/dashboard.js", include_in_schema=False)
    async def dashboard_script() -> Response:
        return Response(_static("dashboard.js"), media_type="text/javascript; charset=utf-8")

    # Not in /openapi.json: the operator's page and its feed, not the API clients program against (and
    # an endless event stream is no operation a spec-driven client can call and check).
    @app.get("/v1/dashboard/snapshot", dependencies=auth, include_in_schema=False)
    async def dashboard_snapshot() -> JSONResponse:
        return JSONResponse(feeds.current().snapshot())

    @app.get("/v1/dashboard/stream", dependencies=auth, include_in_schema=False)
    async def dashboard_stream() -> Response:
        if streams.open >= MAX_STREAMS:
            raise RequestError(f"{MAX_STREAMS} dashboard streams are open already; close one", 429,
                               code="too_many_dashboard_streams")
        return StreamingResponse(streams.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return feeds
