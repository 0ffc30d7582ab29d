"""When a request passed each stage inside the engine, and the three numbers that place a slowdown.

Seed 001 ends on observation: queue time, first-token latency minus queue time, and decode
throughput tell in which stage a request lost its time; finer questions need per-stage timing. Each
request keeps a short list of stage events (arrived, scheduled with the tokens found in the prefix
cache, each prefill chunk, preempted, first token, finished), stamped with one process's monotonic
clock and reported as seconds since the request arrived, so no timestamp from another process is
ever mixed in (the seed's point about time stats across processes).

Decode steps add no events (a long generation would grow the list by a token each); they are in the
summary as a throughput. The list is bounded all the same (MAX_EVENTS), for a request preempted
again and again.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

MAX_EVENTS = 64


@dataclass
class StageEvent:
    stage: str  # arrived | scheduled | prefill_chunk | preempted | first_token | finished
    at: float  # seconds since the request arrived
    tokens: int = 0  # prefill_chunk: tokens computed; scheduled: tokens the prefix cache held
    reason: str | None = None  # finished: the finish reason


class RequestTimeline:
    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.events = [StageEvent("arrived", 0.0)]
        self.dropped = 0  # events past MAX_EVENTS
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0

    def add(self, stage: str, tokens: int = 0, reason: str | None = None, now: float | None = None) -> None:
        at = (time.monotonic() if now is None else now) - self.arrival
        if stage == "first_token":
            self.first_token_at = at
        if len(self.events) < MAX_EVENTS:
            self.events.append(StageEvent(stage, at, tokens, reason))
        else:
            self.dropped += 1

    def tokens_out(self, count: int, now: float | None = None) -> None:
        """`count` output tokens appended at `now` (the first one also marks the first_token event)."""
        if count <= 0:
            return
        at = (time.monotonic() if now is None else now) - self.arrival
        if self.first_token_at is None:
            self.add("first_token", now=self.arrival + at)
        self.last_token_at = at
        self.num_output_tokens += count

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first admission (None while still waiting)."""
        return next((e.at for e in self.events if e.stage == "scheduled"), None)

    def summary(self) -> dict[str, Any]:
        """SGLang's three numbers and their neighbours, in seconds (None where a stage never came):
        queue_time (arrival to first scheduled), prefill_time (first scheduled to first token, i.e.
        first-token latency minus queue time), first_token_latency, decode_throughput (tokens after
        the first per second), plus preemption and prefill-chunk counts and the events themselves."""
        scheduled = self.queue_time
        first = self.first_token_at
        decode_tokens = self.num_output_tokens - 1
        decode_time = None if first is None or self.last_token_at is None else self.last_token_at - first
        return {
            "queue_time": scheduled,
            "prefill_time": None if first is None or scheduled is None else first - scheduled,
            "first_token_latency": first,
            "decode_throughput": decode_tokens / decode_time if decode_time and decode_tokens > 0 else None,
            "num_output_tokens": self.num_output_tokens,
            "num_preemptions": sum(e.stage == "preempted" for e in self.events),
            "num_prefill_chunks": sum(e.stage == "prefill_chunk" for e in self.events),
            "events": [asdict(e) for e in self.events],
            "events_dropped": self.dropped,
        }
