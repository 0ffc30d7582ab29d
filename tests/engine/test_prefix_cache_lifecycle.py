"""Thousands of requests with shared prefixes through a pool small enough to force eviction and
preemption, with random aborts, salts and follow-up turns; every page accounted for after every step,
and matches that continue part way into a cached page copied from it (the fake runner checks every
slot a row reads)."""

from __future__ import annotations

import random

from tests.engine.fake_runner import make_engine, reference_output, run_to_completion
from tokenmill.sample.sampling_params import SamplingParams

PAGE = 4


def test_randomized_prefix_cache_lifecycle():
    rng = random.Random(5)
    # 64 pages of 4 tokens; prompts reach ~90 tokens plus up to 24 outputs, 8 running at once.
    engine, runner = make_engine(kv_cache_tokens=256, page_size=PAGE, max_num_batched_tokens=64, max_num_seqs=8)
    systems = [[rng.randrange(1, 50) for _ in range(rng.randint(0, 60))] for _ in range(6)]
    salts = [None, None, None, "a", "b"]
    expected: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    salt_of: dict[str, str | None] = {}
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    aborted: set[str] = set()
    num_requests = 2000
    next_id = 0
    while next_id < num_requests or engine.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            if next_id >= num_requests:
                break
            done = [r for r in expected if r not in engine.requests and r not in aborted]
            if done and rng.random() < 0.2:
                # A follow-up turn: an earlier request's prompt + output + a new message.
                prev = rng.choice(done[-50:])
                prompt = prompts[prev] + expected[prev] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 8))]
                salt = salt_of[prev]
            else:
                prompt = rng.choice(systems) + [rng.randrange(1, 50) for _ in range(rng.randint(1, 30))]
                salt = rng.choice(salts)
            prompt = prompt[-100:]
            n = rng.randint(1, 24)
            rid = str(next_id)
            next_id += 1
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n), cache_salt=salt)
            prompts[rid], salt_of[rid], expected[rid] = prompt, salt, reference_output(prompt, n)
        if engine.requests and rng.random() < 0.04:
            victim = rng.choice(sorted(engine.requests))
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
        engine.check_integrity()
    outputs.update({k: outputs.get(k, []) + v for k, v in run_to_completion(engine).items()})

    for rid, want in expected.items():
        got = outputs.get(rid, [])
        assert got == (want[: len(got)] if rid in aborted else want), rid
        assert cached.get(rid, 0) < len(prompts[rid])
    # Some matches took part of a page: the copies fed rows whose every slot the runner checked.
    assert len(runner.copies) > 50 and sum(c % PAGE != 0 for c in cached.values()) > 50
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_pages_evicted"] > 0
    assert stats["prefix_cache_hit_rate"] > 0.1  # ~0.16: salts split the space, eviction is heavy
    # Idle: nothing held by a request, every cached page evictable, and evicting them all empties the pool.
    cache = engine.scheduler.cache
    assert stats["kv_pages_in_use"] == 0 and cache.num_locked_pages == 0
    assert cache.num_evictable_pages == cache.num_pages == stats["kv_pages_cached"]
    assert engine.reset_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages
    engine.check_integrity()
