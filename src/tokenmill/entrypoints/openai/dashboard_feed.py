"""What the live dashboard shows, as one JSON-ready dict: built from the scheduler's last pushed
SchedulerStats and the API process's own sliding window, never by asking the engine.

One snapshot is built per tick (`DashboardFeed.snapshot` caches it for `interval_s`) however many
pages watch, and none is built while none does. Rates (tokens/s, steps/s, mean step time, recent
prefix-cache hit rate) are deltas between two stats messages on the scheduler's own clock (`time_s`),
never a difference of timestamps taken in two processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from tokenmill.ipc.messages import SchedulerStats

DEFAULT_INTERVAL_S = 0.25
# The scheduler pushes stats every 0.25 s while busy and once when it goes idle: older than this,
# the last rates describe a burst that is over.
STALE_AFTER_S = 1.0
# Two messages further apart than this (the first after an idle spell; a very long step) give no rates:
# an average over the idle time would understate the burst that just began.
MAX_RATE_SPAN_S = 5.0


def engine_view(s: SchedulerStats, prev: SchedulerStats | None) -> dict[str, Any]:
    """One engine (replica): counts as they are, rates since the previous message."""
    queries = s.prefix_cache_queries_tokens_total
    view: dict[str, Any] = {
        "running": s.num_requests_running,
        "waiting": s.num_requests_waiting,
        "preempted": s.num_requests_preempted,
        "preemptions_total": s.num_preemptions,
        "kv_pages_total": s.kv_pages_total,
        "kv_pages_free": s.kv_pages_free,
        "kv_pages_cached": s.kv_pages_cached,
        "kv_pages_in_use": s.kv_pages_in_use,
        "prompt_tokens_total": s.prompt_tokens_total,
        "generation_tokens_total": s.generation_tokens_total,
        "prefix_cache_hit_rate": s.prefix_cache_hit_tokens_total / queries if queries else None,
        "prefix_tree_top": s.prefix_tree_top,
        "kv_groups": s.kv_groups,  # hybrid KV cache: pages per KV group ([] for one group)
        "step": {
            "prefill_tokens": s.last_step_prefill_tokens,
            "decode_rows": s.last_step_decode_rows,
            "draft_tokens": s.last_step_draft_tokens,
            "num_tokens": s.last_step_num_tokens,
            "token_budget": s.step_token_budget,
            "time_ms": s.last_step_time_s * 1e3,
            "count_total": s.step_count_total,
        },
        "rates": _rates(s, prev),
    }
    return view


def _rates(s: SchedulerStats, prev: SchedulerStats | None) -> dict[str, float | None]:
    dt = s.time_s - prev.time_s if prev is not None else 0.0
    if prev is None or not 0 < dt <= MAX_RATE_SPAN_S:
        return {"generation_tokens_per_s": 0.0, "prompt_tokens_per_s": 0.0, "steps_per_s": 0.0,
                "mean_step_ms": None, "busy": 0.0, "prefix_cache_hit_rate": None}
    steps = s.step_count_total - prev.step_count_total
    step_time = s.step_time_total_s - prev.step_time_total_s
    queries = s.prefix_cache_queries_tokens_total - prev.prefix_cache_queries_tokens_total
    hits = s.prefix_cache_hit_tokens_total - prev.prefix_cache_hit_tokens_total
    return {
        "generation_tokens_per_s": (s.generation_tokens_total - prev.generation_tokens_total) / dt,
        "prompt_tokens_per_s": (s.step_prefill_tokens_total - prev.step_prefill_tokens_total) / dt,
        "steps_per_s": steps / dt,
        "mean_step_ms": step_time / steps * 1e3 if steps else None,
        "busy": min(1.0, step_time / dt),  # share of the interval the engine spent in steps
        "prefix_cache_hit_rate": hits / queries if queries else None,
    }


class _StatsTrack:
    """The last two distinct stats messages of one engine (or the sum of all), and when this process
    first saw the newest: `view` gives no rates once that is older than STALE_AFTER_S."""

    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None
        self.prev: SchedulerStats | None = None
        self.seen_at = 0.0

    def view(self, stats: SchedulerStats | None, now: float) -> dict[str, Any] | None:
        if stats is None:
            return None
        if stats is not self.stats:
            self.prev, self.stats, self.seen_at = self.stats, stats, now
        fresh = now - self.seen_at <= STALE_AFTER_S
        return engine_view(stats, self.prev if fresh else None) | {"age_s": now - self.seen_at}


class DashboardFeed:
    """Builds the snapshot the page draws; `manager` returns the live TokenizerManager (or a fake),
    `replicas` the data-parallel router (`replica_stats()`: (index, live, stats) each) or None."""

    def __init__(self, manager: Callable[[], Any], interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, replicas: Callable[[], Any] = lambda: None) -> None:
        self.manager = manager
        self.replicas = replicas
        self.interval_s = interval_s
        self.clock = clock
        self.seq = 0
        self._built_at: float | None = None
        self._snapshot: dict[str, Any] = {}
        self._total = _StatsTrack()
        self._per_replica: dict[int, _StatsTrack] = {}

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        if self._built_at is None or now - self._built_at >= self.interval_s * 0.9:
            self._snapshot = self._build(now)
            self._built_at = now
        return self._snapshot

    def _build(self, now: float) -> dict[str, Any]:
        manager = self.manager()
        engine = self._total.view(getattr(manager, "stats", None), now)
        live = getattr(manager, "live", None)
        latency = live.summary() if live is not None else None
        limits = getattr(manager, "limits", None)
        self.seq += 1
        return {
            "seq": self.seq,
            "time": time.time(),
            "interval_s": self.interval_s,
            "model": limits.model_name if limits is not None else None,
            "status": "draining" if getattr(manager, "draining", False) else manager.status.value,
            "queued_frontend": getattr(manager, "num_queued", 0),
            "engine": engine,
            # One entry per engine (with --data-parallel-size, each replica's own stats and rates);
            # the page draws a panel per entry once there is more than one.
            "replicas": self._replica_views(now, engine),
            "latency": _latency_view(latency, now) if latency is not None else None,
        }


    def _replica_views(self, now: float, engine: dict[str, Any] | None) -> list[dict[str, Any]]:
        router = self.replicas()
        if router is None:
            return [] if engine is None else [engine | {"replica": 0, "live": True}]
        views = []
        for index, live, stats in router.replica_stats():
            view = self._per_replica.setdefault(index, _StatsTrack()).view(stats, now)
            views.append((view or {}) | {"replica": index, "live": live})
        return views


def _latency_view(summary: dict[str, Any], now: float) -> dict[str, Any]:
    slowest = []
    for f in summary.pop("slowest"):
        request_id = f.seq_id.rsplit("-", 1)[0]  # sequence `{request id}-{k}` (n samples of one request)
        slowest.append({"id": f.seq_id, "request_id": request_id, "e2e_s": f.e2e_s, "ago_s": now - f.at,
                        "finish_reason": f.finish_reason, "output_tokens": f.output_tokens,
                        "timeline_url": f"/v1/requests/{quote(request_id, safe='')}/timeline"})
    return summary | {"slowest": slowest}
