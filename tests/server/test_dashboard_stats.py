"""What feeds the live dashboard: the engine's step counters (engine/step_stats.py), the radix tree's
shared-prefix summary, the API process's sliding latency window (frontend/live_latency.py) and the
snapshot built from them (entrypoints/openai/dashboard_feed.py). No model, no server."""

from __future__ import annotations

import random

from tests.engine.fake_runner import make_engine
from tokenmill.engine.step_stats import DASHBOARD_STATS, PrefixTreeSummary
from tokenmill.entrypoints.openai.dashboard_feed import DashboardFeed
from tokenmill.frontend.live_latency import LiveLatency, percentiles
from tokenmill.frontend.server_status import ServerStatus
from tokenmill.ipc.messages import SchedulerStats, TextOutput
from tokenmill.kvcache.page_pool import PagePool
from tokenmill.kvcache.radix_cache import RadixCache
from tokenmill.sample.sampling_params import SamplingParams


def test_step_stats_record_each_steps_composition_and_totals():
    engine, _ = make_engine(kv_cache_tokens=256, page_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(1, 21)), params)  # 20 tokens: chunks of 16 then 4
    engine.step()
    s = engine.stats()
    assert (s["last_step_prefill_tokens"], s["last_step_decode_rows"], s["last_step_num_tokens"]) == (16, 0, 16)
    assert s["step_token_budget"] == 16 and s["step_count_total"] == 1 and s["last_step_time_s"] > 0
    engine.add_request("b", [5, 6, 7, 8, 9, 10], params)
    engine.step()  # a: its last 4 prompt tokens; b: its 6
    engine.step()  # both decode
    s = engine.stats()
    assert (s["last_step_prefill_tokens"], s["last_step_decode_rows"], s["last_step_num_tokens"]) == (0, 2, 2)
    assert s["step_prefill_tokens_total"] == 16 + 4 + 6 and s["step_decode_rows_total"] == 2
    assert s["step_count_total"] == 3
    assert s["step_time_total_s"] >= s["last_step_time_s"]
    assert set(DASHBOARD_STATS) <= set(s)  # every field the stats message carries is in stats()


def test_preempted_requests_are_counted_while_they_wait():
    rng = random.Random(1)
    engine, _ = make_engine(kv_cache_tokens=48, page_size=4, max_num_batched_tokens=8)
    for i in range(6):
        prompt = [rng.randrange(1, 50) for _ in range(14)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    seen = 0
    while engine.has_unfinished():
        engine.step()
        s = engine.stats()
        waiting_preempted = sum(r.status.value == "preempted" for r in engine.scheduler.waiting)
        assert s["num_requests_preempted"] == waiting_preempted <= s["num_requests_waiting"]
        seen = max(seen, s["num_requests_preempted"])
    assert seen > 0 and engine.stats()["num_requests_preempted"] == 0


def test_shared_prefixes_are_branch_points_and_doubly_locked_paths_longest_first():
    cache = RadixCache(PagePool(64, 4))
    system = list(range(100, 116))  # 4 pages every sequence starts with
    a = cache.insert(system + [1, 2, 3, 4], cache.pool.allocate(5))
    b = cache.insert(system + [5, 6, 7, 8], cache.pool.allocate(4) + cache.pool.allocate(1))
    cache.insert([9, 9, 9, 9, 8, 8, 8, 8], cache.pool.allocate(2), salt="tenant")
    # The second insert split the first edge after the system prompt: that node branches.
    assert [tuple(p) for p in cache.shared_prefixes()] == [(16, 0, 2, False)]
    cache.lock(a.node)
    cache.lock(b.node)
    top = cache.shared_prefixes()
    assert top[0].tokens == 16 and top[0].lock_ref == 2 and top[0].branches == 2 and not top[0].salted
    s = cache.match([9, 9, 9, 9, 8, 8, 8, 8], salt="tenant")
    cache.lock(s.node)
    cache.lock(s.node)  # two running requests of that tenant on one path
    top = cache.shared_prefixes(limit=5)
    assert [(p.tokens, p.lock_ref, p.salted) for p in top] == [(16, 2, False), (8, 2, True)]
    assert len(cache.shared_prefixes(limit=1)) == 1


def test_prefix_tree_summary_walks_at_most_every_interval_unless_fresh():
    cache = RadixCache(PagePool(16, 4))
    summary = PrefixTreeSummary(interval_s=2.0)
    assert summary.get(None, 0.0) == []
    assert summary.get(cache, 0.0) == []
    x = cache.insert([1, 1, 1, 1, 2, 2, 2, 2], cache.pool.allocate(2))
    y = cache.insert([1, 1, 1, 1, 3, 3, 3, 3], cache.pool.allocate(2))
    cache.lock(x.node)
    cache.lock(y.node)
    assert summary.get(cache, 1.0) == []  # within the interval: the last answer
    assert summary.get(cache, 2.5)[0]["tokens"] == 4
    cache.unlock(x.node)
    assert summary.get(cache, 3.0)[0]["lock_ref"] == 2
    assert summary.get(cache, 3.0, fresh=True)[0]["lock_ref"] == 1


def test_weighted_percentiles():
    assert percentiles([]) == {"count": 0, "p50": None, "p90": None, "p99": None, "max": None}
    p = percentiles([(float(v), 1) for v in range(1, 101)])
    assert (p["count"], p["p50"], p["p90"], p["p99"], p["max"]) == (100, 50.0, 90.0, 99.0, 100.0)
    # an inter-token sample of k tokens counts k times
    p = percentiles([(0.01, 98), (1.0, 2)])
    assert (p["count"], p["p50"], p["p90"], p["p99"]) == (100, 0.01, 0.01, 1.0)


def _out(rid: str, tokens: int, finished: bool = False) -> TextOutput:
    return TextOutput(rid, "x" * tokens, list(range(tokens)), finished, "length" if finished else None, None, tokens)


def test_live_latency_forgets_what_left_the_window_and_ranks_the_slowest():
    now = [100.0]
    live = LiveLatency(window_s=10.0, clock=lambda: now[0])
    live.observe(_out("old-0", 1, finished=True), 91.0, 90.0, None)  # TTFT 1 s, e2e 1 s, at t=91
    live.observe(_out("a-0", 1), 99.0, 98.5, None)  # TTFT 0.5 s
    live.observe(_out("a-0", 4), 99.4, 98.5, 99.0)  # 4 tokens in 0.4 s: ITL 0.1 s x 4
    live.observe(_out("a-0", 0, finished=True), 99.5, 98.5, 99.4)
    live.observe(_out("b-0", 1, finished=True), 99.6, 99.5, None)
    s = live.summary()
    assert s["ttft"]["count"] == 3 and s["ttft"]["max"] == 1.0
    assert s["itl"]["count"] == 4 and abs(s["itl"]["p50"] - 0.1) < 1e-9
    assert [f.seq_id for f in s["slowest"]] == ["old-0", "a-0", "b-0"]
    now[0] = 102.0  # t=91 is now out of the 10 s window
    s = live.summary()
    assert s["ttft"]["count"] == 2 and [f.seq_id for f in s["slowest"]] == ["a-0", "b-0"]


def _stats(t: float, gen: int, steps: int, step_time: float, **kw: int) -> SchedulerStats:
    base = dict(num_requests_running=2, num_requests_waiting=1, kv_pages_total=100, kv_pages_in_use=30,
                prompt_tokens_total=50, generation_tokens_total=gen, prefix_cache_hit_tokens_total=kw.pop("hits", 0),
                num_preemptions=0, time_s=t, step_count_total=steps, step_time_total_s=step_time,
                kv_pages_free=60, kv_pages_cached=10, step_token_budget=2048, last_step_decode_rows=2,
                last_step_num_tokens=2, last_step_time_s=0.02)
    return SchedulerStats(**(base | kw))


class _Manager:
    status = ServerStatus.UP
    draining = False
    limits = None
    num_queued = 3

    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None
        self.live = LiveLatency()


def test_feed_turns_two_stats_messages_into_rates_on_the_schedulers_clock():
    clock = [0.0]
    manager = _Manager()
    feed = DashboardFeed(lambda: manager, interval_s=0.25, clock=lambda: clock[0])
    snap = feed.snapshot()
    assert snap["engine"] is None and snap["replicas"] == [] and snap["queued_frontend"] == 3
    manager.stats = _stats(10.0, gen=100, steps=10, step_time=0.2, prefix_cache_queries_tokens_total=100, hits=40)
    clock[0] = 0.3
    snap = feed.snapshot()
    assert snap["engine"]["rates"]["generation_tokens_per_s"] == 0.0  # one message: no rate yet
    assert snap["engine"]["prefix_cache_hit_rate"] == 0.4
    manager.stats = _stats(10.5, gen=150, steps=20, step_time=0.6, prefix_cache_queries_tokens_total=200, hits=140)
    clock[0] = 0.35
    assert feed.snapshot()["seq"] == 2  # built at most once per interval, however many pages ask
    clock[0] = 0.6
    snap = feed.snapshot()
    rates = snap["engine"]["rates"]
    assert abs(rates["generation_tokens_per_s"] - 100.0) < 1e-9  # 50 tokens in 0.5 s of the scheduler's clock
    assert abs(rates["mean_step_ms"] - 40.0) < 1e-9 and abs(rates["busy"] - 0.8) < 1e-9
    assert rates["prefix_cache_hit_rate"] == 1.0  # this interval's queries all hit
    assert snap["engine"]["step"]["decode_rows"] == 2
    assert snap["replicas"] == [snap["engine"] | {"replica": 0, "live": True}]
    clock[0] = 5.0  # no message for a while: the engine went idle, the burst is over
    assert feed.snapshot()["engine"]["rates"]["generation_tokens_per_s"] == 0.0


def test_feed_gives_each_data_parallel_replica_its_own_panel_and_rates():
    class Router:
        def __init__(self) -> None:
            self.stats: list[SchedulerStats | None] = [None, None]

        def replica_stats(self) -> list[tuple[int, bool, SchedulerStats | None]]:
            return [(0, True, self.stats[0]), (1, False, self.stats[1])]

    clock = [0.0]
    router = Router()
    feed = DashboardFeed(_Manager, interval_s=0.25, clock=lambda: clock[0], replicas=lambda: router)
    assert feed.snapshot()["replicas"] == [{"replica": 0, "live": True}, {"replica": 1, "live": False}]
    router.stats = [_stats(1.0, gen=10, steps=1, step_time=0.1), _stats(7.0, gen=500, steps=5, step_time=0.5)]
    clock[0] = 0.3
    feed.snapshot()
    router.stats[0] = _stats(2.0, gen=30, steps=3, step_time=0.3)  # replica 1 sent nothing new
    clock[0] = 0.6
    first, second = feed.snapshot()["replicas"]
    assert first["replica"] == 0 and first["rates"]["generation_tokens_per_s"] == 20.0  # on replica 0's clock
    assert second["live"] is False and second["rates"]["generation_tokens_per_s"] == 0.0
    assert second["generation_tokens_total"] == 500


def test_feed_links_the_slowest_requests_to_their_timelines():
    manager = _Manager()
    now = manager.live.clock()
    manager.live.observe(_out("chatcmpl-a/b-1", 3, finished=True), now, now - 2.0, None)
    snap = DashboardFeed(lambda: manager).snapshot()
    (item,) = snap["latency"]["slowest"]
    assert item["request_id"] == "chatcmpl-a/b" and item["timeline_url"] == "/v1/requests/chatcmpl-a%2Fb/timeline"
    assert abs(item["e2e_s"] - 2.0) < 1e-6 and item["output_tokens"] == 3
