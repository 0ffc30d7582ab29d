"""The prefix cache inside the engine, on the paging-checking FakeRunner."""

from __future__ import annotations

import pytest

from tests.engine.fake_runner import make_engine, reference_output, run_to_completion
from tokenmill.engine.request import IllegalTransition, RequestStatus
from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def spy_on_schedule(engine) -> list[list[tuple[str, int, int]]]:
    """Per step: (request id, tokens already computed, tokens computed now) of every chunk."""
    log: list[list[tuple[str, int, int]]] = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        log.append([(c.request.request_id, c.request.num_computed_tokens, c.num_tokens) for c in out.chunks])
        return out

    engine.scheduler.schedule = spy
    return log


def run(engine, rid: str, prompt: list[int], max_tokens: int = 4, **kw) -> tuple[list[int], int]:
    """Runs one request alone; returns its output and the num_cached_tokens its outputs reported."""
    engine.add_request(rid, prompt, greedy(max_tokens), **kw)
    tokens, cached = [], set()
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            cached.add(out.num_cached_tokens)
        engine.check_integrity()
    assert len(cached) == 1
    assert tokens == reference_output(prompt, max_tokens)
    return tokens, cached.pop()


PROMPT = [(i * 7) % 45 + 1 for i in range(40)]  # 40 tokens: pages 0-1 full, page 2 partial


@pytest.mark.parametrize(
    "second,cached,whole_pages",
    [
        # A full hit still recomputes the last token. Page 2 of the first request never filled (40
        # prompt tokens + 3 outputs with K/V), so only whole pages 0-1 are in the tree.
        (PROMPT, 32, 32),
        (PROMPT[:35] + [3, 3, 3], 32, 32),  # shares 35 tokens: two whole pages
        # Exactly two pages: page 1 holds its 15 tokens before the last one, copied.
        (PROMPT[:32], 31, 16),
        (PROMPT[:20] + [5] * 30, 20, 16),  # a page and 4 tokens of the next
        (PROMPT[:15] + [5] * 30, 15, 0),  # less than a page in common: the copy is all of it
        ([9] + PROMPT[1:], 0, 0),
    ],
)
@pytest.mark.parametrize("copies", [True, False])
def test_cached_tokens_equal_the_shared_prefix(second, cached, whole_pages, copies):
    """With the runner's page copy a request takes every token of the cached pages that continue its
    prompt (the last one excepted); without it, whole pages only."""
    engine, runner = make_engine(page_size=16)
    if not copies:
        engine.scheduler.prefix.copy_page = None
        cached = whole_pages
    run(engine, "a", PROMPT)
    log = spy_on_schedule(engine)
    _, reported = run(engine, "b", second)
    assert reported == cached
    assert log[0] == [("b", cached, len(second) - cached)]  # it computes only the rest
    assert len(runner.copies) == (cached > whole_pages)
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens_total"] == cached
    assert stats["prefix_cache_queries_tokens_total"] == len(PROMPT) + len(second)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(cached / (len(PROMPT) + len(second)))


def test_a_partial_page_is_copied_into_the_requests_own_page():
    engine, runner = make_engine(page_size=16)
    run(engine, "a", PROMPT[:24], max_tokens=12)  # 35 positions with K/V: pages 0-1 go to the tree
    tree_pages = set(engine.scheduler.cache.all_pages())
    engine.add_request("b", PROMPT[:24], greedy(3))
    engine.step()
    (b,) = engine.scheduler.running
    assert b.num_cached_tokens == 23 and b.num_tree_pages == 1
    (src, dst), = runner.copies
    assert src in tree_pages and dst == b.pages[1] and dst not in tree_pages
    run_to_completion(engine)
    engine.check_integrity()


def test_a_copy_admission_that_finds_no_room_gives_up_the_copy():
    # 5 pages: "a" leaves pages 0-1 cached, "c" takes the other 3. "b" (a full hit: page 0 shared,
    # 7 tokens of page 1 to copy) finds no free page while "c" runs: holding page 1 for the copy is
    # what keeps it, so "b" gives the copy up, page 1 is evicted for its own, and it computes those
    # tokens itself, now rather than after "c".
    engine, runner = make_engine(page_size=16, kv_cache_tokens=80, max_num_seqs=4)
    run(engine, "a", PROMPT[:24], max_tokens=12)
    engine.add_request("c", [7] * 40, greedy(8))
    engine.step()
    engine.add_request("b", PROMPT[:24], greedy(3))
    first = [t for out in engine.step() if out.request_id == "b" for t in out.new_token_ids]
    assert [r.request_id for r in engine.scheduler.running] == ["c", "b"] and not runner.copies
    engine.check_integrity()
    assert first + run_to_completion(engine)["b"] == reference_output(PROMPT[:24], 3) and not runner.copies
    engine.check_integrity()


def test_a_prompt_sharing_less_than_a_page_with_a_long_cached_one_is_admitted():
    # 10 pages of 16. "a" leaves a 128-token prompt (8 pages, one edge of the tree) cached; "b"
    # shares its first 5 tokens only, so it would copy a's first page, and needs 5 pages of 2 free.
    # Its hold on that page once locked a's whole edge, so no eviction could make room: "b" waited
    # forever. Now the edge is split after the page it copies, and the other 7 can be evicted.
    engine, runner = make_engine(page_size=16, kv_cache_tokens=160, max_num_seqs=4)
    long = [(i * 11) % 45 + 1 for i in range(128)]
    run(engine, "a", long, max_tokens=1)
    other = long[:5] + [(i * 13) % 41 + 2 for i in range(60)]
    engine.add_request("b", other, greedy(4))
    first = [t for out in engine.step() for t in out.new_token_ids]
    assert [r.request_id for r in engine.scheduler.running] == ["b"] and len(runner.copies) == 1
    engine.check_integrity()
    assert first + run_to_completion(engine)["b"] == reference_output(other, 4)
    engine.check_integrity()


def test_output_tokens_are_cached_too():
    engine, _ = make_engine(page_size=8)
    prompt = PROMPT[:10]
    out, _ = run(engine, "a", prompt, max_tokens=20)
    # The next turn of a conversation: prompt + reply + more. 29 tokens have K/V (the last output's
    # never does), so 24 are cached in whole pages.
    _, cached = run(engine, "b", prompt + out + [1, 2, 3])
    assert cached == 24


def test_a_request_admitted_while_another_decodes_shares_its_prompt():
    engine, _ = make_engine(page_size=16)
    log = spy_on_schedule(engine)
    engine.add_request("a", PROMPT, greedy(30))
    engine.step()  # a's prefill: its two full pages go to the tree now, not at its end
    engine.add_request("b", PROMPT[:36], greedy(5))
    first = {o.request_id: o.new_token_ids for o in engine.step()}
    assert log[1] == [("a", 40, 1), ("b", 32, 4)]
    a, b = engine.scheduler.running
    assert a.pages[:2] == b.pages[:2] and b.num_tree_pages == 2
    assert engine.stats()["kv_pages_cached"] == 2
    outputs = run_to_completion(engine)
    assert first["b"] + outputs["b"] == reference_output(PROMPT[:36], 5)
    assert engine.stats()["kv_pages_in_use"] == 0


def test_a_shared_prefix_computed_twice_at_once_is_stored_once():
    # Different prompts (identical ones would be prefilled one after the other, see test_n_samples.py)
    # with the same two full pages, computed in the same step.
    other = PROMPT[:-1] + [PROMPT[-1] % 40 + 1]
    engine, _ = make_engine(page_size=16)
    engine.add_request("a", PROMPT, greedy(20))
    engine.add_request("b", other, greedy(20))
    first = {o.request_id: o.new_token_ids for o in engine.step()}
    # b switched to a's two full pages and freed its own.
    a, b = engine.scheduler.running
    assert a.pages[:2] == b.pages[:2]
    assert engine.stats()["kv_pages_cached"] + engine.stats()["kv_pages_in_use"] == 4
    outputs = run_to_completion(engine)
    assert first["a"] + outputs["a"] == reference_output(PROMPT, 20)
    assert first["b"] + outputs["b"] == reference_output(other, 20)


def test_cache_salts_never_share():
    engine, _ = make_engine(page_size=16)
    run(engine, "a", PROMPT, cache_salt="tenant-1")
    assert run(engine, "b", PROMPT, cache_salt="tenant-2")[1] == 0
    assert run(engine, "c", PROMPT)[1] == 0
    assert run(engine, "d", PROMPT, cache_salt="tenant-1")[1] == 32
    assert run(engine, "e", PROMPT)[1] == 32
    with pytest.raises(InvalidRequest):
        engine.add_request("f", PROMPT, greedy(1), cache_salt=3)


def test_prefix_caching_can_be_turned_off():
    engine, _ = make_engine(page_size=16, enable_prefix_caching=False)
    run(engine, "a", PROMPT)
    assert run(engine, "b", PROMPT)[1] == 0
    stats = engine.stats()
    assert stats["kv_pages_cached"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["prefix_cache_queries_tokens_total"] == 0 and stats["prefix_cache_hit_rate"] == 0.0


def test_an_aborted_request_leaves_its_computed_pages_cached():
    engine, _ = make_engine(page_size=8)
    prompt = PROMPT[:10]
    engine.add_request("a", prompt, greedy(30))
    produced: list[int] = []
    while len(produced) < 20:
        produced += engine.step()[0].new_token_ids
    assert engine.abort_request("a")
    # 29 tokens have K/V: 3 whole pages (including output tokens) are now the tree's.
    assert engine.stats()["kv_pages_cached"] == 3 and engine.stats()["kv_pages_in_use"] == 0
    _, cached = run(engine, "retry", prompt + produced[:-1])
    assert cached == 24


def test_preempted_requests_cache_their_pages_and_recompute_only_what_was_evicted():
    # 11 pages of 4 tokens. a and b fill the pool; b (newest) is preempted, its full pages go to the
    # tree, and a's later pages come out of b's tail one eviction at a time.
    engine, _ = make_engine(kv_cache_tokens=44, page_size=4, max_num_seqs=2)
    log = spy_on_schedule(engine)
    a, b = [1 + i % 40 for i in range(12)], [2 + i % 40 for i in range(16)]
    engine.add_request("a", a, greedy(20))
    engine.add_request("b", b, greedy(12))
    outputs = run_to_completion(engine)
    assert outputs == {"a": reference_output(a, 20), "b": reference_output(b, 12)}
    stats = engine.stats()
    assert stats["num_preemptions"] >= 1 and stats["kv_pages_evicted"] >= 1
    # b's first chunk after preemption starts from what the tree still had of it, not from zero.
    recompute = next(start for step in log[1:] for rid, start, n in step if rid == "b" and n > 1)
    assert 0 < recompute < len(b) + 12 - 1


def test_cached_pages_are_evicted_before_any_request_is_preempted():
    engine, _ = make_engine(kv_cache_tokens=64, page_size=4, max_num_seqs=1)
    for i in range(6):  # each leaves 3-4 pages cached: the pool is soon all cache
        run(engine, str(i), [i + 1] * 14, max_tokens=3)
    stats = engine.stats()
    assert stats["kv_pages_evicted"] > 0 and stats["num_preemptions"] == 0
    assert stats["kv_pages_cached"] + stats["kv_pages_free"] == stats["kv_pages_total"]
    assert engine.reset_prefix_cache() and engine.stats()["kv_pages_free"] == stats["kv_pages_total"]


def test_release_twice_and_illegal_moves_raise():
    engine, _ = make_engine(page_size=4)
    engine.add_request("a", PROMPT, greedy(5))
    engine.step()
    request = engine.requests["a"]
    sched = engine.scheduler
    sched.finish(request, RequestStatus.FINISHED_ABORTED)
    with pytest.raises(IllegalTransition):
        sched.finish(request, RequestStatus.FINISHED_ABORTED)  # a second release
    with pytest.raises(IllegalTransition):
        request.move_to(RequestStatus.RUNNING)
    engine.requests.pop("a")
    assert not engine.abort_request("a")  # the public abort of an ended request stays harmless
    engine.check_integrity()


def test_the_integrity_check_catches_broken_accounting():
    engine, _ = make_engine(page_size=4)
    engine.add_request("a", PROMPT, greedy(5))
    engine.add_request("b", PROMPT, greedy(5))
    engine.step()
    engine.step()  # b (same prompt) is admitted once a's prefill is in the tree
    engine.check_integrity()
    request = engine.scheduler.running[1]
    request.tree_node.lock_ref += 1  # a lock nobody holds
    with pytest.raises(AssertionError, match="lock_ref"):
        engine.check_integrity()
    request.tree_node.lock_ref -= 1
    page = request.pages[-1]
    request.pages.append(page)  # a page counted twice
    with pytest.raises(AssertionError):
        engine.check_integrity()
    request.pages.pop()
    engine.check_integrity()
