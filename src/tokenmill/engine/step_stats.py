"""What the engine's steps look like, for the live dashboard (`GET /dashboard`) and `stats()`.

Every step adds a few integers here (its prefill tokens, decode rows, draft tokens, budget used and
wall time): no allocation in the hot path beyond the loop over the step's chunks that the engine runs
anyway. Totals let the reader turn two snapshots into rates on one clock (the scheduler's), and the
last step's composition is kept as it was.

Anything that walks a structure (the waiting queue for preempted requests, the radix tree for its
largest shared prefixes) runs only when stats are read, at the scheduler's stats cadence, and the tree
walk at a slower one of its own (`PrefixTreeSummary`), so a watched dashboard cannot slow the engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tokenmill.engine.request import RequestStatus

if TYPE_CHECKING:
    from tokenmill.engine.scheduler import ScheduledChunk, Scheduler
    from tokenmill.kvcache.radix_cache import RadixCache


# stats() keys that SchedulerStats carries under the same names, for the dashboard.
DASHBOARD_STATS = (
    "num_requests_preempted", "kv_pages_free", "kv_pages_cached", "prefix_cache_queries_tokens_total",
    "step_token_budget", "step_count_total", "step_time_total_s", "step_prefill_tokens_total",
    "step_decode_rows_total", "last_step_prefill_tokens", "last_step_decode_rows", "last_step_draft_tokens",
    "last_step_num_tokens", "last_step_time_s",
)


class StepStats:
    __slots__ = ("token_budget", "_started", "num_steps", "time_total_s", "prefill_tokens_total",
                 "decode_rows_total", "last_prefill_tokens", "last_decode_rows", "last_draft_tokens",
                 "last_num_tokens", "last_time_s")

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget  # max_num_batched_tokens: what "budget used" is a share of
        self._started = 0.0
        self.num_steps = 0  # steps that ran the model (a step with nothing scheduled does not count)
        self.time_total_s = 0.0
        self.prefill_tokens_total = 0
        self.decode_rows_total = 0
        self.last_prefill_tokens = 0
        self.last_decode_rows = 0
        self.last_draft_tokens = 0
        self.last_num_tokens = 0
        self.last_time_s = 0.0

    def begin(self) -> None:
        self._started = time.perf_counter()

    def end(self, chunks: Iterable[ScheduledChunk]) -> None:
        """The step that began at the last `begin()` ran `chunks` (schedule, forward, sample, append)."""
        elapsed = time.perf_counter() - self._started
        prefill = rows = drafts = tokens = 0
        for c in chunks:
            tokens += c.num_tokens
            if c.num_drafts or c.num_tokens == 1:
                # A decode row, possibly with speculative drafts to verify. A prompt whose every
                # page but the last token hit the cache also computes 1 token: it costs a row too.
                rows += 1
                drafts += c.num_drafts
            else:
                prefill += c.num_tokens
        self.num_steps += 1
        self.time_total_s += elapsed
        self.prefill_tokens_total += prefill
        self.decode_rows_total += rows
        self.last_prefill_tokens, self.last_decode_rows, self.last_draft_tokens = prefill, rows, drafts
        self.last_num_tokens, self.last_time_s = tokens, elapsed

    def as_dict(self, scheduler: Scheduler) -> dict[str, int | float]:
        cache = scheduler.cache
        return {
            # Preempted requests wait again (at the front of the queue) to recompute; read here, not
            # kept per step: the queue is bounded by --max-queued-requests.
            "num_requests_preempted": sum(1 for r in scheduler.waiting if r.status is RequestStatus.PREEMPTED),
            "kv_pages_evicted": cache.num_evicted_pages if cache is not None else 0,
            "step_token_budget": self.token_budget,
            "step_count_total": self.num_steps,
            "step_time_total_s": self.time_total_s,
            "step_prefill_tokens_total": self.prefill_tokens_total,
            "step_decode_rows_total": self.decode_rows_total,
            "last_step_prefill_tokens": self.last_prefill_tokens,
            "last_step_decode_rows": self.last_decode_rows,
            "last_step_draft_tokens": self.last_draft_tokens,
            "last_step_num_tokens": self.last_num_tokens,
            "last_step_time_s": self.last_time_s,
        }


class PrefixTreeSummary:
    """The radix tree's largest shared prefixes, recomputed at most every `interval_s` seconds.

    The summary walks the tree (up to RadixCache's node cap); between walks the last answer is
    reused, so its cost is bounded however often stats are read."""

    def __init__(self, interval_s: float = 2.0, limit: int = 5) -> None:
        self.interval_s = interval_s
        self.limit = limit
        self._at: float | None = None
        self._last: list[dict[str, Any]] = []

    def get(self, cache: RadixCache | None, now: float, fresh: bool = False) -> list[dict[str, Any]]:
        """fresh: walk now whatever the interval (the engine just went idle: the walk costs nothing)."""
        if cache is None:
            return []
        if fresh or self._at is None or now - self._at >= self.interval_s:
            self._at = now
            self._last = [p._asdict() for p in cache.shared_prefixes(self.limit)]
        return self._last
