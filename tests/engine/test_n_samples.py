"""Requests with one prompt (n samples) prefill it once; prompt logprobs are computed chunk by chunk.

All on the paging-checking FakeRunner, where `prompt_tokens_computed_total` counts exactly the prompt
positions that went through the "model".
"""

from __future__ import annotations

import random

from tests.engine.fake_runner import make_engine, next_token, reference_output, run_to_completion
from tokenmill.sample.sampling_params import SamplingParams

PAGE = 16


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 45 + 1 for i in range(length)]


def add_samples(engine, rid: str, prompt: list[int], n: int, max_tokens: int = 5, **kw) -> None:
    for k in range(n):
        engine.add_request(f"{rid}-{k}", prompt, greedy(max_tokens), **kw)


def shared_bound(prompt_len: int, n: int) -> int:
    """One full prefill, then each sibling recomputes only what follows the last full shareable page."""
    return prompt_len + (n - 1) * (prompt_len - (prompt_len - 1) // PAGE * PAGE)


def test_n_samples_prefill_the_prompt_once():
    engine, _ = make_engine(page_size=PAGE)
    prompt = prompt_of(50)
    add_samples(engine, "p", prompt, 4)
    outputs = run_to_completion(engine)
    computed = engine.stats()["prompt_tokens_computed_total"]
    assert computed == shared_bound(50, 4) == 50 + 3 * 2
    assert computed <= 50 + 3 * PAGE
    assert all(outputs[f"p-{k}"] == reference_output(prompt, 5) for k in range(4))
    assert engine.stats()["prompt_tokens_total"] == 4 * 50  # what was asked, unchanged


def test_a_chunked_prompt_is_still_prefilled_once():
    engine, runner = make_engine(page_size=PAGE, max_num_batched_tokens=32)
    prompt = prompt_of(100)
    add_samples(engine, "p", prompt, 4)
    run_to_completion(engine)
    assert engine.stats()["prompt_tokens_computed_total"] == shared_bound(100, 4) == 112
    # The full pages are in the tree after the third chunk: the siblings join the first sample's last
    # chunk, each computing the last 4 tokens.
    assert runner.steps[3].count((96, 4, True)) == 4


def test_other_requests_are_not_held_up_by_waiting_siblings():
    engine, runner = make_engine(page_size=PAGE)
    add_samples(engine, "p", prompt_of(50), 3)
    engine.add_request("other", prompt_of(30, salt=3), greedy(5))
    engine.step()
    # The first sample and the unrelated request prefill together; the other samples wait a step.
    assert sorted(runner.steps[0]) == [(0, 30, True), (0, 50, True)]
    engine.step()
    assert sorted(runner.steps[1]) == [(30, 1, True), (48, 2, True), (48, 2, True), (50, 1, True)]
    run_to_completion(engine)


def test_short_prompts_salts_and_no_cache_do_not_defer():
    # Nothing to share within one page: all four run at once.
    engine, runner = make_engine(page_size=PAGE)
    add_samples(engine, "p", prompt_of(16), 4)
    engine.step()
    assert len(runner.steps[0]) == 4
    # Different cache salts never share, so they are different groups.
    engine, runner = make_engine(page_size=PAGE)
    for k in range(3):
        engine.add_request(f"s-{k}", prompt_of(50), greedy(3), cache_salt=f"tenant-{k}")
    engine.step()
    assert len(runner.steps[0]) == 3
    run_to_completion(engine)
    # Without a prefix cache there is nothing to wait for.
    engine, runner = make_engine(page_size=PAGE, enable_prefix_caching=False)
    add_samples(engine, "p", prompt_of(50), 4)
    run_to_completion(engine)
    assert len(runner.steps[0]) == 4 and engine.stats()["prompt_tokens_computed_total"] == 200


def test_duplicate_prompts_under_memory_pressure_finish_correctly():
    # Small pool: preemptions hit first samples mid-prefill and siblings mid-wait; nothing deadlocks,
    # outputs stay exact, and the integrity check holds after every step.
    rng = random.Random(7)
    engine, _ = make_engine(page_size=4, kv_cache_tokens=96, max_num_batched_tokens=24)
    expected = {}
    for i in range(8):
        prompt = prompt_of(rng.randint(10, 40), salt=i % 3)
        n, max_tokens = rng.randint(1, 4), rng.randint(3, 20)
        add_samples(engine, f"r{i}", prompt, n, max_tokens)
        expected.update({f"r{i}-{k}": reference_output(prompt, max_tokens) for k in range(n)})
    assert run_to_completion(engine) == expected
    assert engine.stats()["num_preemptions"] > 0


def fake_prompt_logprobs_ok(prompt: list[int], entries) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        lp = entries[i]
        assert lp.token_id == prompt[i]
        # The FakeRunner's only likely token after prompt[:i] is next_token(prompt[:i]).
        assert lp.top[0][0] == next_token(prompt[:i], 50) and len(lp.top) == 2
        assert (lp.logprob > -1e-3) == (prompt[i] == lp.top[0][0])


def collect(engine, watch=None, seen: list | None = None) -> dict[str, list]:
    found: dict[str, list] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        if watch is not None and watch.num_preemptions and not seen:
            seen.append(len(watch.prompt_logprobs))  # entries scored when it was preempted
        for out in outputs:
            if out.prompt_logprobs is not None:
                assert out.request_id not in found, "prompt logprobs are sent once"
                found[out.request_id] = out.prompt_logprobs
        engine.check_integrity()
    return found


def test_prompt_logprobs_with_chunks_a_cached_prefix_and_samples():
    engine, _ = make_engine(page_size=PAGE, max_num_batched_tokens=24)
    prompt = prompt_of(70)
    engine.add_request("warm", prompt, greedy(2))
    run_to_completion(engine)
    before = engine.stats()["prompt_tokens_computed_total"]
    # The prompt is cached now, but a cached prefix has no logits: the request computes it all.
    engine.add_request("lp", prompt, greedy(3, prompt_logprobs=2))
    engine.add_request("plain", prompt, greedy(3))
    found = collect(engine)
    assert set(found) == {"lp"}
    fake_prompt_logprobs_ok(prompt, found["lp"])
    assert engine.stats()["prompt_tokens_computed_total"] - before == 70 + (70 - 64)


def test_prompt_logprobs_survive_a_preemption_mid_prefill():
    engine, _ = make_engine(page_size=4, kv_cache_tokens=48, max_num_batched_tokens=8)
    engine.add_request("old", prompt_of(24, salt=1), greedy(22))
    engine.step()
    prompt = prompt_of(30, salt=2)
    engine.add_request("lp", prompt, greedy(4, prompt_logprobs=1))
    request, seen = engine.requests["lp"], []
    found = collect(engine, request, seen)
    assert request.num_preemptions >= 1 and 1 < seen[0] < 30  # preempted with part of its prompt scored
    entries = found["lp"]
    assert len(entries) == 30 and entries[0] is None
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    assert all(e.top[0][0] == next_token(prompt[:i], 50) for i, e in enumerate(entries) if i)
