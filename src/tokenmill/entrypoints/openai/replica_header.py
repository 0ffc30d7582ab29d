"""The `x-tokenmill-replica` response header: which data-parallel replica served the request.

The router (frontend/dp_router.py) appends each replica it picks to a list held in a contextvar that
this middleware sets for the request, so no handler passes anything along. The header goes out with
the response's first bytes: a non-streamed response knows its replica by then; a stream sends its
headers before the engine request is queued, so its replica is found through the timeline endpoint
(`GET /v1/requests/{id}/timeline`, field `replica`) instead.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.frontend.dp_router import routed_replicas

HEADER = b"x-tokenmill-replica"


class ReplicaHeaderMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chosen: list[int] = []
        token = routed_replicas.set(chosen)

        async def send_with_replica(message: Message) -> None:
            if message["type"] == "http.response.start" and chosen:
                # n samples share one replica; the list holds one entry per sequence.
                value = ",".join(str(i) for i in sorted(set(chosen))).encode()
                message = {**message, "headers": [*message.get("headers", []), (HEADER, value)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_replica)
        finally:
            routed_replicas.reset(token)
