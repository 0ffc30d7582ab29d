"""Data-parallel routing: each policy on its own (pure), and the router's bookkeeping (n > 1 samples on
one replica, aborts follow their request, a dead replica's requests fail, handshakes wait for all)."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from tokenmill.frontend.dp_controller import (
    LeastRequests,
    LeastTokens,
    PrefixAware,
    PrefixTree,
    ReplicaLoad,
    RoundRobin,
    make_policy,
)
from tokenmill.frontend.dp_router import DataParallelRouter, routed_replicas
from tokenmill.ipc.channels import IpcPaths
from tokenmill.ipc.messages import (
    AbortRequest,
    AddRequest,
    DetokenizerReady,
    RequestFailed,
    SchedulerReady,
    SchedulerStats,
    TextBatch,
    TextOutput,
)
from tokenmill.sample.sampling_params import SamplingParams


def loads(*requests: int, tokens: tuple[int, ...] | None = None, dead: tuple[int, ...] = ()) -> list[ReplicaLoad]:
    tokens = tokens or (0,) * len(requests)
    return [ReplicaLoad(i, i not in dead, n, t) for i, (n, t) in enumerate(zip(requests, tokens))]


PROMPT = list(range(100, 164))  # 64 tokens: four 16-token blocks


# ---- policies ---------------------------------------------------------------------------------
def test_round_robin_cycles_over_live_replicas_only():
    policy = RoundRobin()
    assert [policy.choose(PROMPT, None, loads(0, 0, 0)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    picks = {policy.choose(PROMPT, None, loads(0, 0, 0, dead=(1,))) for _ in range(6)}
    assert picks == {0, 2}


def test_least_requests_picks_fewest_unfinished_and_skips_dead():
    policy = LeastRequests()
    assert policy.choose(PROMPT, None, loads(3, 1, 2)) == 1
    assert policy.choose(PROMPT, None, loads(3, 1, 2, dead=(1,))) == 2
    assert policy.choose(PROMPT, None, loads(2, 2)) == 0  # ties: the lower index


def test_least_tokens_picks_fewest_tokens_not_fewest_requests():
    policy = LeastTokens()
    # replica 0 has fewer requests but a long prompt queued
    assert policy.choose(PROMPT, None, loads(1, 3, tokens=(5000, 300))) == 1
    assert policy.choose(PROMPT, None, loads(1, 3, tokens=(5000, 300), dead=(1,))) == 0


def test_no_live_replica_is_an_error():
    for method in ("round_robin", "least_requests", "least_tokens", "prefix_aware"):
        with pytest.raises(ValueError, match="no live replica"):
            make_policy(method, 2).choose(PROMPT, None, loads(0, 0, dead=(0, 1)))
    with pytest.raises(ValueError, match="load_balance_method"):
        make_policy("random", 2)


def test_prefix_aware_follows_the_cached_prefix_then_falls_back_to_load():
    policy = PrefixAware(2)
    first = policy.choose(PROMPT, None, loads(0, 0))
    assert first == 0
    # The same system prompt + a new question goes where the prefix is, despite a little more load there.
    assert policy.choose(PROMPT + [7, 8, 9], None, loads(2, 1)) == 0
    # An unrelated prompt goes to the least loaded replica, and is remembered there.
    other = list(range(500, 548))
    assert policy.choose(other, None, loads(2, 1)) == 1
    assert policy.choose(other + [1], None, loads(1, 2)) == 1
    # Too unbalanced for a cache hit to pay: load wins over the match.
    assert policy.choose(PROMPT, None, loads(30, 2)) == 1
    # A dead replica's tree is dropped: its prefix no longer attracts requests.
    policy.forget(0)
    assert policy.trees[0].match(PROMPT, None) == 0


def test_prefix_aware_never_matches_across_cache_salts():
    policy = PrefixAware(2)
    assert policy.choose(PROMPT, "tenant-a", loads(0, 0)) == 0
    assert policy.trees[0].match(PROMPT, "tenant-a") == 64
    assert policy.trees[0].match(PROMPT, "tenant-b") == 0
    assert policy.trees[0].match(PROMPT, None) == 0
    # tenant b with the same tokens is routed by load (replica 1 is idler), not to a's cache
    assert policy.choose(PROMPT, "tenant-b", loads(1, 0)) == 1
    assert policy.choose(PROMPT, "tenant-a", loads(1, 0)) == 0


def test_prefix_tree_matches_whole_blocks_and_evicts_leaves_first():
    tree = PrefixTree(block_size=16, max_nodes=4)
    tree.insert(PROMPT + [1] * 15, None)  # four full blocks; the 15-token tail is no block
    assert len(tree) == 4
    assert tree.match(PROMPT, None) == 64
    assert tree.match(PROMPT[:40], None) == 32
    assert tree.match([0] + PROMPT[1:], None) == 0  # a differing first token: no shared prefix
    tree.insert(list(range(900, 932)), None)  # two new nodes push out the two oldest: PROMPT's leaves
    assert len(tree) == 4
    assert tree.match(PROMPT, None) == 32  # its first two blocks (the parents) survive
    assert tree.match(list(range(900, 932)), None) == 32


# ---- the router ---------------------------------------------------------------------------------
class RecordingSender:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)


def run_router(method: str, body, size: int = 2) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        paths = IpcPaths.create()
        router = DataParallelRouter(ctx, paths, size, method)
        for replica in router.replicas:
            replica.sender = RecordingSender()
        try:
            await body(router)
        finally:
            await router.close()
            ctx.destroy(linger=0)
            paths.remove()

    asyncio.run(main())


def add(rid: str, prompt: list[int] | None = None, salt: str | None = None) -> AddRequest:
    return AddRequest(rid, prompt or PROMPT, SamplingParams(max_tokens=4), salt)


def sent_ids(router: DataParallelRouter) -> list[list[str]]:
    return [[m.request_id for m in r.sender.sent] for r in router.replicas]


def finished(rid: str) -> TextBatch:
    return TextBatch([TextOutput(rid, "x", [1], True, "length", None, 1)])


def test_n_samples_of_one_request_stay_on_one_replica():
    async def body(router: DataParallelRouter) -> None:
        box: list[int] = []
        routed_replicas.set(box)
        for rid in ("a-0", "a-1", "a-2", "b-0", "b-1"):
            router.send(add(rid))
        assert sent_ids(router) == [["a-0", "a-1", "a-2"], ["b-0", "b-1"]]
        assert box == [0, 0, 0, 1, 1]  # what the x-tokenmill-replica header reads
        assert [r.num_requests for r in router.loads()] == [3, 2]

    run_router("round_robin", body)


def test_finish_and_abort_update_the_load_and_follow_the_request():
    async def body(router: DataParallelRouter) -> None:
        router.send(add("a-0"))
        router.send(add("b-0"))
        router._observe(router.replicas[0], finished("a-0"))
        assert [r.num_requests for r in router.loads()] == [0, 1]
        assert router.replica_of("a-0") == 0  # remembered after it finished (the timeline's field)
        router.send(AbortRequest("b-0"))
        assert isinstance(router.replicas[1].sender.sent[-1], AbortRequest)
        assert [r.num_requests for r in router.loads()] == [0, 0]
        router.send(AbortRequest("b-0"))  # already gone: nothing more is sent anywhere
        assert len(router.replicas[1].sender.sent) == 2

    run_router("least_requests", body)


def test_least_tokens_counts_reported_tokens_plus_what_was_sent_since():
    async def body(router: DataParallelRouter) -> None:
        router._observe(router.replicas[0], SchedulerStats(0, 0, 10, 0, 0, 0, 0, 0, num_tokens=100))
        router._observe(router.replicas[1], SchedulerStats(0, 0, 10, 0, 0, 0, 0, 0, num_tokens=50))
        router.send(add("a-0", list(range(80))))  # 50 < 100: replica 1, now 130
        router.send(add("b-0", list(range(10))))  # 100 < 130: replica 0
        assert sent_ids(router) == [["b-0"], ["a-0"]]
        assert [r.num_tokens for r in router.loads()] == [110, 130]
        router._observe(router.replicas[1], SchedulerStats(0, 0, 10, 0, 0, 0, 0, 0, num_tokens=20))
        assert router.loads()[1].num_tokens == 20  # a fresh report replaces the estimate

    run_router("least_tokens", body)


def test_handshakes_pass_once_every_replica_reported_and_stats_are_summed():
    async def body(router: DataParallelRouter) -> None:
        ready = SchedulerReady("m", 2048, 49152, 8192, True, True)
        assert router._observe(router.replicas[0], ready) == []
        assert router._observe(router.replicas[0], DetokenizerReady()) == []
        assert router._observe(router.replicas[1], DetokenizerReady()) == [DetokenizerReady()]
        assert router._observe(router.replicas[1], ready) == [ready]
        router._observe(router.replicas[0], SchedulerStats(2, 1, 10, 4, 100, 50, 0, 0))
        (total,) = router._observe(router.replicas[1], SchedulerStats(1, 0, 10, 2, 30, 20, 0, 1))
        assert (total.num_requests_running, total.kv_pages_total, total.prompt_tokens_total) == (3, 20, 130)

    run_router("round_robin", body)


def test_a_dead_replica_fails_its_requests_and_new_ones_go_to_the_live_one():
    async def body(router: DataParallelRouter) -> None:
        dead: list[str] = []
        router.on_all_dead = lambda name, code: dead.append(name)
        for r in router.replicas:
            router._observe(r, SchedulerReady("m", 2048, 49152, 8192, True, True))
            router._observe(r, DetokenizerReady())
        router._observe(router.replicas[1], SchedulerStats(2, 0, 10, 4, 0, 0, 0, 0, num_tokens=9))
        for rid in ("a-0", "a-1", "b-0", "c-0"):
            router.send(add(rid))
        assert sent_ids(router) == [["a-0", "a-1", "c-0"], ["b-0"]]
        router.on_process_exit("scheduler-0", -9)
        failed = [router._queue.get_nowait() for _ in range(3)]
        assert sorted(m.request_id for m in failed) == ["a-0", "a-1", "c-0"]
        assert all(isinstance(m, RequestFailed) and m.status == 503 and "replica 0" in m.message for m in failed)
        # ... and are aborted there, in case its scheduler outlived its detokenizer
        assert [m.request_id for m in router.replicas[0].sender.sent[3:]] == ["a-0", "a-1", "c-0"]
        assert all(isinstance(m, AbortRequest) for m in router.replicas[0].sender.sent[3:])
        assert router.num_live == 1 and dead == []
        for rid in ("d-0", "e-0"):
            router.send(add(rid))
        assert sent_ids(router)[1] == ["b-0", "d-0", "e-0"]
        (index, live, stats), _ = router.replica_stats()
        assert (index, live) == (0, False)
        router.on_process_exit("detokenizer-1", 1)
        assert router.num_live == 0 and dead == ["detokenizer-1"]

    run_router("round_robin", body)


def test_a_replica_dying_during_start_up_fails_the_start():
    async def body(router: DataParallelRouter) -> None:
        dead: list[str] = []
        router.on_all_dead = lambda name, code: dead.append(name)
        router.on_process_exit("scheduler-1", 1)
        assert dead == ["scheduler-1"]

    run_router("round_robin", body)


# ---- configuration and process layout ---------------------------------------------------------------
def test_threads_are_split_among_replicas_each_pair_in_its_own_directory(tmp_path):
    from tokenmill.config import DataParallelConfig, EngineConfig
    from tokenmill.entrypoints.openai.processes import ChildProcesses

    paths = IpcPaths(str(tmp_path))
    children = ChildProcesses(paths, EngineConfig(num_threads=5), None, "INFO", DataParallelConfig(2))
    commands = dict(children.commands())
    assert list(commands) == ["scheduler-0", "detokenizer-0", "scheduler-1", "detokenizer-1"]
    for i in (0, 1):
        scheduler = commands[f"scheduler-{i}"]
        assert scheduler[scheduler.index("--ipc-dir") + 1] == str(tmp_path / f"r{i}")
        assert '"num_threads": 2' in scheduler[scheduler.index("--config") + 1]  # 5 // 2
        assert scheduler[-2:] == ["--replica", str(i)]
    single = dict(ChildProcesses(paths, EngineConfig(num_threads=1), None, "INFO").commands())
    assert list(single) == ["scheduler", "detokenizer"] and '"num_threads": 1' in single["scheduler"][-1]
    assert DataParallelConfig(4).replica_threads(2) == 1  # never 0


def test_bad_data_parallel_settings_and_the_offline_api_are_refused():
    from tokenmill.config import DataParallelConfig, EngineConfig
    from tokenmill.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="data_parallel_size must be an integer >= 1"):
        DataParallelConfig(0)
    with pytest.raises(InvalidRequest, match="load_balance_method must be one of"):
        DataParallelConfig(2, "fastest")
    with pytest.raises(InvalidRequest, match="unknown engine argument") as info:
        EngineConfig.from_kwargs(data_parallel_size=2)  # not an engine's setting: LLM / serve handle it
    assert info.value.param == "data_parallel_size"
