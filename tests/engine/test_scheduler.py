from __future__ import annotations

import random

import pytest

from tests.engine.fake_runner import make_engine, reference_output, run_to_completion
from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import SamplingParams


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def random_prompts(n: int, rng: random.Random, lo: int = 1, hi: int = 80) -> list[list[int]]:
    return [[rng.randrange(1, 50) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_many_requests_match_running_alone_and_free_everything():
    rng = random.Random(0)
    engine, _ = make_engine(kv_cache_tokens=4096, page_size=16, max_num_batched_tokens=128)
    prompts = random_prompts(20, rng)
    lengths = [rng.randint(1, 30) for _ in prompts]
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), p, greedy(n))
    outputs = run_to_completion(engine)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        assert outputs[str(i)] == reference_output(p, n)
    stats = engine.stats()
    # Nothing is held by a request any more; what is not free is the prefix cache's (evictable).
    assert stats["kv_pages_in_use"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]


def test_long_prompt_is_prefilled_in_chunks_under_the_budget():
    engine, runner = make_engine(max_num_batched_tokens=32)
    prompt = list(range(1, 50)) * 2  # 98 tokens
    engine.add_request("a", prompt, greedy(3))
    outputs = run_to_completion(engine)
    assert outputs["a"] == reference_output(prompt, 3)
    # 98 tokens under a budget of 32: chunks of 32, 32, 32, 2 and only the last one samples.
    assert [s[0] for s in runner.steps[:4]] == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 2, True)]
    assert all(sum(n for _, n, _ in step) <= 32 for step in runner.steps)


def test_decode_rows_and_prefill_chunks_share_a_step():
    engine, runner = make_engine(max_num_batched_tokens=64)
    engine.add_request("short", [1, 2, 3], greedy(10))
    engine.step()  # prefill of "short"
    engine.add_request("long", list(range(1, 49)) * 3, greedy(2))
    engine.step()
    step = runner.steps[-1]
    assert step[0] == (3, 1, True)  # the decode row of "short"
    assert step[1] == (0, 63, False)  # a prefill chunk of "long" fills the rest of the budget
    run_to_completion(engine)


def test_preemption_recomputes_and_outputs_do_not_change():
    rng = random.Random(1)
    # 12 pages of 4 tokens: far too few for 8 requests of up to ~40 tokens each at once.
    engine, _ = make_engine(kv_cache_tokens=48, page_size=4, max_num_batched_tokens=64)
    prompts = random_prompts(8, rng, 2, 20)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(20))
    outputs = run_to_completion(engine)
    assert engine.stats()["num_preemptions"] > 0
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == reference_output(p, 20)
    assert engine.stats()["kv_pages_in_use"] == 0


def test_max_num_seqs_caps_running_requests():
    engine, runner = make_engine(max_num_seqs=3)
    for i in range(7):
        engine.add_request(str(i), [1, 2, 3, 4], greedy(5))
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 3
    assert max(len(s) for s in runner.steps) == 3


def test_finished_requests_leave_and_waiting_ones_join_each_step():
    engine, runner = make_engine(max_num_seqs=2)
    engine.add_request("a", [1, 2], greedy(1))
    engine.add_request("b", [3, 4], greedy(5))
    engine.add_request("c", [5, 6], greedy(1))
    engine.step()  # a and b prefill; a finishes at once
    engine.step()  # c joins next to b's decode row
    assert runner.steps[1] == [(2, 1, True), (0, 2, True)]


def test_abort_frees_pages_and_a_second_abort_is_harmless():
    engine, _ = make_engine()
    engine.add_request("a", list(range(1, 40)), greedy(50))
    engine.add_request("b", list(range(1, 10)), greedy(50))
    engine.step()
    assert engine.stats()["kv_pages_in_use"] > 0
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    assert engine.abort_request("b")  # b was still running: aborted from the running list
    assert engine.stats()["kv_pages_in_use"] == 0
    assert not engine.has_unfinished()


def test_abort_while_waiting():
    engine, _ = make_engine(max_num_seqs=1)
    engine.add_request("a", [1, 2], greedy(5))
    engine.add_request("b", [1, 2], greedy(5))
    first = engine.step()
    assert [o.request_id for o in first] == ["a"]
    assert engine.abort_request("b")
    outputs = run_to_completion(engine)
    assert "b" not in outputs and len(outputs["a"]) == 4  # plus the one from the first step


def test_eos_and_stop_token_ids_and_min_tokens():
    engine, _ = make_engine()
    prompt = [1, 2, 3]
    expected = reference_output(prompt, 10)
    stop_at = expected[4]
    engine.add_request("stop", prompt, greedy(10, stop_token_ids=[stop_at]))
    engine.add_request("min", prompt, greedy(10, stop_token_ids=[stop_at], min_tokens=8))
    finals = {}
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    first = expected.index(stop_at) + 1
    assert outputs["stop"] == expected[:first]  # the stop token is the last one returned
    assert finals["stop"].finish_reason == "stop" and finals["stop"].stop_reason == stop_at
    assert len(outputs["min"]) >= 8 and stop_at not in outputs["min"][:7]


@pytest.mark.parametrize(
    "prompt,params,param",
    [
        ([], greedy(4), "prompt"),
        ([1, 2, 99], greedy(4), "prompt"),
        ([1] * 10, greedy(200), "max_tokens"),  # beyond the 128-token context below
        ([1] * 200, greedy(4), "prompt"),
    ],
)
def test_requests_that_can_never_run_are_rejected_up_front(prompt, params, param):
    engine, _ = make_engine(max_model_len=128)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("x", prompt, params)
    assert e.value.param == param
    assert not engine.has_unfinished()


def test_request_larger_than_the_pool_is_rejected():
    engine, _ = make_engine(kv_cache_tokens=64, page_size=16)
    with pytest.raises(InvalidRequest, match="KV cache"):
        engine.add_request("x", [1] * 60, greedy(10))


def test_randomized_lifecycle_keeps_every_page_accounted_for():
    rng = random.Random(7)
    engine, _ = make_engine(kv_cache_tokens=160, page_size=8, max_num_batched_tokens=48, max_num_seqs=6)
    expected: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    aborted: set[str] = set()
    next_id = 0
    for _ in range(400):
        if rng.random() < 0.3 and next_id < 120:
            p = random_prompts(1, rng, 1, 60)[0]
            n = rng.randint(1, 40)
            rid = str(next_id)
            next_id += 1
            engine.add_request(rid, p, greedy(n))
            expected[rid] = reference_output(p, n)
        if rng.random() < 0.05 and engine.requests:
            victim = rng.choice(sorted(engine.requests))
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    outputs.update({k: outputs.get(k, []) + v for k, v in run_to_completion(engine).items()})
    for rid, want in expected.items():
        got = outputs.get(rid, [])
        if rid in aborted:
            assert got == want[: len(got)]
        else:
            assert got == want
    assert engine.stats()["kv_pages_in_use"] == 0


def test_an_uncounted_request_runs_like_any_other_but_adds_no_tokens_to_the_counters():
    # The server's /health probe (counted=False) is real work, not traffic: the request token
    # counters that /metrics exports are the callers' alone.
    engine, _ = make_engine()
    engine.add_request("probe", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), counted=False)
    engine.add_request("user", [8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outputs = run_to_completion(engine)
    assert len(outputs["probe"]) == 4 and len(outputs["user"]) == 3
    stats = engine.stats()
    assert (stats["prompt_tokens_total"], stats["generation_tokens_total"]) == (2, 3)
