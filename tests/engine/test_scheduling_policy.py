"""Priority scheduling (`scheduling_policy="priority"`): admission by (priority, arrival), the
lowest-priority running request preempted first, an urgent request displacing a running one, and
first come first served refusing priorities it would ignore. Outputs never change, only their order."""

from __future__ import annotations

import pytest

from tests.engine.fake_runner import make_engine, reference_output, run_to_completion
from tokenmill.config import EngineConfig
from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import SamplingParams


def greedy(max_tokens: int, priority: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, priority=priority)


def step(engine, outputs: dict[str, list[int]]) -> None:
    for out in engine.step():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.check_integrity()


def finish_order(engine) -> list[str]:
    order: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
        engine.check_integrity()
    return order


def test_fcfs_refuses_a_priority_it_would_ignore():
    engine, _ = make_engine()
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("a", [1, 2, 3], greedy(2, priority=1))
    assert e.value.param == "priority" and "scheduling_policy" in str(e.value)
    engine.add_request("b", [1, 2, 3], greedy(2, priority=0))  # the default is fine
    assert run_to_completion(engine)["b"] == reference_output([1, 2, 3], 2)


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(InvalidRequest) as e:
        EngineConfig(scheduling_policy="lottery")
    assert e.value.param == "scheduling_policy"


def test_priority_admits_lower_numbers_first_then_by_arrival():
    engine, _ = make_engine(scheduling_policy="priority", max_num_seqs=1)
    priorities = {"a": 2, "b": 1, "c": 0, "d": 1, "e": 2, "f": -3}
    for rid, priority in priorities.items():
        engine.add_request(rid, [1, 2, 3, len(rid)], greedy(3, priority))
    assert finish_order(engine) == ["f", "c", "b", "d", "a", "e"]


def test_fcfs_keeps_arrival_order():
    engine, _ = make_engine(max_num_seqs=1)
    for rid in "abcd":
        engine.add_request(rid, [4, 5, 6], greedy(3))
    assert finish_order(engine) == list("abcd")


def test_an_urgent_request_displaces_the_lowest_priority_running_one():
    engine, _ = make_engine(scheduling_policy="priority", max_num_seqs=2)
    prompts = {rid: [7, 8, 9, i + 1] for i, rid in enumerate("abcd")}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(20, priority=1))
    outputs: dict[str, list[int]] = {}
    step(engine, outputs)
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"a", "b"}
    engine.add_request("urgent", [3, 3, 3], greedy(4, priority=0))
    step(engine, outputs)
    running = {r.request_id for r in engine.scheduler.running}
    assert "urgent" in running and running == {"a", "urgent"}  # b, the newer of the two, made room
    b = engine.requests["b"]
    assert b.num_preemptions == 1
    assert [r.request_id for r in engine.scheduler.waiting] == ["b", "c", "d"]  # b keeps its place
    for rid, tokens in run_to_completion(engine).items():
        outputs.setdefault(rid, []).extend(tokens)
    assert outputs["urgent"] == reference_output([3, 3, 3], 4)
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference_output(prompt, 20)
    assert engine.stats()["kv_pages_in_use"] == 0


def test_equal_priority_never_displaces():
    engine, _ = make_engine(scheduling_policy="priority", max_num_seqs=1)
    engine.add_request("first", [1, 2], greedy(5, priority=1))
    engine.step()
    engine.add_request("second", [1, 3], greedy(5, priority=1))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["first"]
    assert engine.requests["first"].num_preemptions == 0
    run_to_completion(engine)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_memory_pressure_preempts_the_lowest_priority_not_the_newest(policy):
    # 6 pages of 4 tokens; two requests of 16 tokens each: one must give its pages back.
    engine, _ = make_engine(scheduling_policy=policy, kv_cache_tokens=24, page_size=4, enable_prefix_caching=False)
    engine.add_request("background", [1, 2, 3], greedy(13, priority=5 if policy == "priority" else 0))
    outputs: dict[str, list[int]] = {}
    step(engine, outputs)
    engine.add_request("interactive", [4, 5, 6], greedy(13))
    background, interactive = engine.requests["background"], engine.requests["interactive"]
    for rid, tokens in run_to_completion(engine).items():
        outputs.setdefault(rid, []).extend(tokens)
    assert outputs["background"] == reference_output([1, 2, 3], 13)
    assert outputs["interactive"] == reference_output([4, 5, 6], 13)
    if policy == "priority":
        assert interactive.num_preemptions == 0 and background.num_preemptions >= 1
    else:  # first come first served preempts the newest
        assert background.num_preemptions == 0 and interactive.num_preemptions >= 1


def test_urgent_request_behind_64_queued_ones_gets_its_first_token_in_the_next_step():
    engine, _ = make_engine(scheduling_policy="priority", max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(72):  # 8 running, 64 queued
        engine.add_request(f"bulk{i}", [5, 6, 7, i % 40 + 1], greedy(30, priority=1))
    outputs: dict[str, list[int]] = {}
    step(engine, outputs)
    assert len(engine.scheduler.waiting) == 64
    engine.add_request("urgent", [9, 9, 9], greedy(3, priority=0))
    step(engine, outputs)
    assert outputs["urgent"] == reference_output([9, 9, 9], 3)[:1]  # served in the very next step
    run_to_completion(engine)
