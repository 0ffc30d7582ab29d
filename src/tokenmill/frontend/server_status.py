"""The server's state as /health reports it, and the interface the request path reports its timings
to (the API server's Prometheus metrics, or nothing in tests). Their own file: the model pool, the
router and the API server speak of them without the tokenizer manager's machinery.
"""

from __future__ import annotations

import enum
from typing import Protocol


class ServerStatus(enum.Enum):
    STARTING = "starting"
    UP = "up"
    UNHEALTHY = "unhealthy"


class MetricsSink(Protocol):
    def observe_queue_time(self, seconds: float) -> None: ...
    def observe_first_token(self, seconds: float) -> None: ...
    def observe_inter_token(self, seconds: float, count: int) -> None: ...
    def observe_finished(self, e2e_seconds: float, finish_reason: str | None) -> None: ...
    def observe_rejected(self, reason: str) -> None: ...
