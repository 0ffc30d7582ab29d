"""GET /metrics: Prometheus metrics, vLLM-style names under the `tokenmill:` prefix.

Engine state (running, waiting, KV use, token totals) is the scheduler's own count, reported in its
SchedulerStats (with data parallelism: one series per replica, labelled `replica`); latencies are
measured here, where the client's clock is: TTFT, inter-token latency and end-to-end from the moment
the HTTP request arrived; queue time is the scheduler's duration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenmill.ipc.messages import SchedulerStats

# Latencies from a few ms (a decode step of a small model) to minutes (a long queue on a CPU).
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)

# Data parallelism: (replica index, alive, its last stats) for each replica (frontend/dp_router.py).
ReplicaStats = Callable[[], list[tuple[int, bool, SchedulerStats | None]]]


prometheus_client.disable_created_metrics()  # the `_created` series double every metric for no use here


class ServerMetrics:
    """One registry per server (not the global one), so several apps can live in one process."""

    def __init__(self, stats: Callable[[], SchedulerStats | None], queued: Callable[[], int] = lambda: 0,
                 replicas: ReplicaStats | None = None) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds", "Time between output tokens",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds", "Request latency, arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("tokenmill:request_queue_time_seconds", "Time in the scheduler's waiting queue",
                               buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("tokenmill:request_success", "Finished sequences by finish reason",
                                ["finished_reason"], registry=self.registry)
        self.rejected = Counter("tokenmill:request_rejected", "Requests refused before queueing, by reason",
                                ["reason"], registry=self.registry)
        self.queued = Gauge("tokenmill:num_requests_queued_frontend",
                            "Sequences sent to the scheduler with no output yet (what --max-queued-requests bounds)",
                            registry=self.registry)
        self.queued.set_function(queued)
        # Embedding requests (POST /v1/embeddings, /api/embed): counted here, apart from generation.
        self.embedding_requests = Counter("tokenmill:embedding_requests", "Embedding requests served",
                                          registry=self.registry)
        self.embedding_tokens = Counter("tokenmill:embedding_prompt_tokens", "Input tokens of embedding requests",
                                        registry=self.registry)
        self.registry.register(_EngineCollector(stats, replicas))

    # MetricsSink (frontend/tokenizer_manager.py)
    def observe_queue_time(self, seconds: float) -> None:
        self.queue.observe(max(0.0, seconds))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float, count: int) -> None:
        for _ in range(count):
            self.itl.observe(seconds)

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def observe_finished(self, e2e_seconds: float, finish_reason: str | None) -> None:
        self.e2e.observe(e2e_seconds)
        self.finished.labels(finished_reason=finish_reason or "unknown").inc()

    def observe_embedding(self, num_tokens: int) -> None:
        self.embedding_requests.inc()
        self.embedding_tokens.inc(num_tokens)

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


def _kv_usage(s: SchedulerStats) -> float:
    return s.kv_pages_in_use / s.kv_pages_total if s.kv_pages_total else 0.0


def _acceptance_rate(s: SchedulerStats) -> float:
    drafted = s.spec_decode_num_draft_tokens_total
    return s.spec_decode_num_accepted_tokens_total / drafted if drafted else 0.0


def _mean_accepted_length(s: SchedulerStats) -> float:
    rows = s.spec_decode_num_drafts_total
    return 1 + s.spec_decode_num_accepted_tokens_total / rows if rows else 0.0


_G, _C = GaugeMetricFamily, CounterMetricFamily
# (family type, name, help, value): the engine's own numbers, from its SchedulerStats. Speculative
# decoding uses vLLM's spec_decode_* names; the rate and the mean length are derived, as gauges.
_ENGINE_METRICS: tuple[tuple[type, str, str, Callable[[SchedulerStats], float]], ...] = (
    (_G, "tokenmill:num_requests_running", "Requests in the running batch", lambda s: s.num_requests_running),
    (_G, "tokenmill:num_requests_waiting", "Requests waiting to be scheduled", lambda s: s.num_requests_waiting),
    (_G, "tokenmill:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full)", _kv_usage),
    (_G, "tokenmill:kv_cache_bytes_per_token", "Bytes of K and V one token holds in the pool (all layers)",
     lambda s: s.kv_cache_bytes_per_token),
    (_C, "tokenmill:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
     lambda s: s.prefix_cache_hit_tokens_total),
    (_C, "tokenmill:prompt_tokens", "Prompt tokens admitted", lambda s: s.prompt_tokens_total),
    (_C, "tokenmill:generation_tokens", "Tokens generated", lambda s: s.generation_tokens_total),
    (_C, "tokenmill:num_preemptions", "Requests preempted", lambda s: s.num_preemptions),
    (_C, "tokenmill:spec_decode_num_drafts", "Verified rows that carried draft tokens",
     lambda s: s.spec_decode_num_drafts_total),
    (_C, "tokenmill:spec_decode_num_draft_tokens", "Draft tokens verified",
     lambda s: s.spec_decode_num_draft_tokens_total),
    (_C, "tokenmill:spec_decode_num_accepted_tokens", "Draft tokens accepted by the target",
     lambda s: s.spec_decode_num_accepted_tokens_total),
    (_C, "tokenmill:spec_decode_num_emitted_tokens", "Tokens emitted by rows with drafts",
     lambda s: s.spec_decode_num_emitted_tokens_total),
    (_G, "tokenmill:spec_decode_acceptance_rate", "Accepted / verified draft tokens", _acceptance_rate),
    (_G, "tokenmill:spec_decode_mean_accepted_length", "Tokens per verified row with drafts (accepted + 1)",
     _mean_accepted_length),
)

# vLLM's cache_config_info: the setting as a label on a constant 1.
_CACHE_INFO = ("tokenmill:cache_config_info", "KV cache settings (cache_dtype: fp32, bf16 or int8)")


class _EngineCollector:
    """One engine: unlabelled series. Data-parallel replicas: every series once per replica with a
    `replica` label (sum them for the server), plus tokenmill:replica_up (1 alive, 0 dead)."""

    def __init__(self, stats: Callable[[], SchedulerStats | None], replicas: ReplicaStats | None = None) -> None:
        self._stats = stats
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        if self._replicas is not None:
            yield from self._collect_replicas(self._replicas())
            return
        s = self._stats()
        if s is None:
            return
        for family, name, doc, value in _ENGINE_METRICS:
            yield family(name, doc, value=value(s))
        info = GaugeMetricFamily(*_CACHE_INFO, labels=["cache_dtype"])
        info.add_metric([s.kv_cache_dtype], 1.0)
        yield info
        if s.kv_groups:
            yield _group_pages([([], s)])

    def _collect_replicas(self, replicas: list[tuple[int, bool, SchedulerStats | None]]) -> Iterator[Metric]:
        up = GaugeMetricFamily("tokenmill:replica_up", "Data-parallel replica alive (1) or dead (0)",
                               labels=["replica"])
        for index, live, _ in replicas:
            up.add_metric([str(index)], 1.0 if live else 0.0)
        yield up
        for family, name, doc, value in _ENGINE_METRICS:
            metric = family(name, doc, labels=["replica"])
            for index, _, s in replicas:
                if s is not None:
                    metric.add_metric([str(index)], value(s))
            yield metric
        info = GaugeMetricFamily(*_CACHE_INFO, labels=["replica", "cache_dtype"])
        for index, _, s in replicas:
            if s is not None:
                info.add_metric([str(index), s.kv_cache_dtype], 1.0)
        yield info
        grouped = [([str(index)], s) for index, _, s in replicas if s is not None and s.kv_groups]
        if grouped:
            yield _group_pages(grouped, ["replica"])


def _group_pages(stats: list[tuple[list[str], SchedulerStats]], labels: list[str] | None = None) -> Metric:
    """Pages per KV group of a hybrid KV cache (kvcache/kv_groups.py), in use by running requests or
    cached in the prefix tree; `window` 0 is the full-attention group."""
    metric = GaugeMetricFamily("tokenmill:kv_group_pages", "KV pages per KV group (hybrid KV cache)",
                               labels=[*(labels or []), "group", "window", "state"])
    for prefix, s in stats:
        for g in s.kv_groups:
            for state in ("in_use", "cached"):
                metric.add_metric([*prefix, str(g["group"]), str(g["window"]), state], g[f"pages_{state}"])
    return metric
