"""The hybrid KV cache on the fake runner: sliding groups free their pages as requests advance.

The fake runner (tests/engine/fake_runner.py) writes every token into each group's pages and checks,
for every sampled row, that each sliding group still holds exactly the window its query sees; the
scheduler's integrity check (free + cached + in use == total, every group's pages accounted for)
runs after every step. So a page freed too early, a page leaked, or a prefix hit served without its
window fails here.
"""

from __future__ import annotations

import random

import pytest

from tests.engine.fake_runner import make_engine, reference_output, run_to_completion
from tests.engine.test_speculative import OracleProposer
from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.engine.factory import attach_disk_tier
from tokenmill.engine.request import RequestStatus
from tokenmill.errors import InvalidRequest
from tokenmill.kvcache.kv_groups import KVGroup, KVLayout
from tokenmill.sample.sampling_params import SamplingParams

PAGE = 4
WINDOW = 10
# 6 layers: 2 full (2, 5), 4 sliding -> group 0 and two sliding groups of two layers.
LAYOUT = KVLayout.for_layers([WINDOW, WINDOW, None, WINDOW, WINDOW, None])
VOCAB = 50


def hybrid_engine(**config):
    config.setdefault("page_size", PAGE)
    return make_engine(VOCAB, kv_layout=LAYOUT, **config)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def held(engine) -> list[int]:
    """Pages held per group by running requests (private), as stats reports them."""
    return engine.scheduler.pages_in_use_by_group()


def test_layout_of_gemma3_270m_and_of_llama():
    windows = [None if i in (5, 11, 17) else 512 for i in range(18)]
    layout = KVLayout.for_layers(windows)
    assert layout.groups[0] == KVGroup((5, 11, 17), None)
    assert [g.layers for g in layout.groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert layout.slots_per_page == 3 and layout.window == 512
    assert layout.placement()[11] == (0, 1) and layout.placement()[6] == (2, 2)
    # 16k tokens at page 16, chunks of 2048: 1024 full pages + 5 groups of at most 160.
    assert layout.pages_needed(16384, 16, 2048) == 1024 + 5 * (-(-(511 + 2048) // 16) + 1)
    assert layout.pages_needed(100, 16, 2048) == 7 * 6  # short: every group holds all of it
    llama = KVLayout.for_layers([None] * 4)
    assert not llama.is_hybrid and llama.slots_per_page == 4 and llama.capacity_tokens(10, 16, 64) == 160
    # No full layer, or two window sizes: one group (full KV everywhere), never wrong.
    assert not KVLayout.for_layers([8, 8]).is_hybrid and not KVLayout.for_layers([8, None, 4]).is_hybrid


def test_capacity_admits_what_fits_and_refuses_what_does_not():
    engine, _ = hybrid_engine(kv_cache_tokens=40 * PAGE, max_num_batched_tokens=8)
    cap = engine.scheduler.capacity_tokens
    assert LAYOUT.pages_needed(cap, PAGE, 8) <= 40 < LAYOUT.pages_needed(cap + PAGE, PAGE, 8)
    # The error says why a request's room is under the pool's 40 pages: the groups, and what to change.
    with pytest.raises(InvalidRequest, match=rf"exceeds the KV cache \({cap} tokens a request\); {40 * PAGE} token "
                                             rf"slots shared by {len(LAYOUT.groups)} KV groups.*prefill chunk of 8\); "
                                             "a larger kv_cache_tokens or a smaller max_num_batched_tokens"):
        engine.add_request("big", [1] * cap, greedy(PAGE))
    engine.add_request("fits", [1] * (cap - 20), greedy(20))
    out = run_to_completion(engine)
    assert out["fits"] == reference_output([1] * (cap - 20), 20, VOCAB)
    # Alone, it never preempts itself: the prompt's window it handed the tree is dropped once its own
    # window has moved on and the pages are needed (a locked path pins full pages only).
    assert engine.stats()["num_preemptions"] == 0


@pytest.mark.parametrize("chunk", [3, 8, 64])
def test_long_prompts_chunked_exact_and_window_pages_freed(chunk):
    engine, runner = hybrid_engine(kv_cache_tokens=512, max_num_batched_tokens=chunk, max_num_seqs=4)
    rng = random.Random(chunk)
    prompts = {str(i): [rng.randrange(1, VOCAB) for _ in range(n)] for i, n in enumerate([5, 37, 61, 90])}
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy(30))
    outputs: dict[str, list[int]] = {}
    bound = LAYOUT.window_pages(PAGE, chunk)
    most = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
        for r in engine.scheduler.running:
            for pages in r.window_pages:
                count = sum(p is not None for p in pages)
                assert count <= bound, (r.request_id, count, bound)
                most = max(most, count)
    assert {rid: outputs[rid] for rid in prompts} == {rid: reference_output(p, 30, VOCAB) for rid, p in prompts.items()}
    assert most < -(-120 // PAGE)  # 90 + 30 tokens would need 30 pages per group without freeing
    assert sum(held(engine)) == 0


def test_decode_frees_one_page_per_page_of_progress():
    engine, _ = hybrid_engine(kv_cache_tokens=512, max_num_batched_tokens=64, enable_prefix_caching=False)
    engine.add_request("a", [3] * 20, greedy(40))
    counts = []
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        if engine.scheduler.running:
            counts.append(held(engine))
    full, *window = counts[-1]
    assert full == -(-59 // PAGE)  # group 0 keeps the whole context
    # After the prompt's step (5 pages), the window (10 tokens) plus the newest token's page:
    # never more than 4 pages of 4 tokens, the step after the one that frees them.
    assert max(counts[0][1:]) == 5 and all(max(c[1:]) <= 4 for c in counts[1:]) and window == [window[0]] * 2
    assert engine.pool.num_free == engine.pool.num_pages  # no prefix cache: all back


def test_preemption_and_abort_release_every_group():
    # 34 pages: a request of 60 tokens needs up to 15 + 2 x 8 (a 16-token chunk and the window before
    # it), 15 + 2 x 4 in decode, so three at once preempt one another.
    engine, _ = hybrid_engine(kv_cache_tokens=34 * PAGE, max_num_batched_tokens=16, max_num_seqs=3)
    rng = random.Random(3)
    prompts = {str(i): [rng.randrange(1, VOCAB) for _ in range(40)] for i in range(4)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy(20))
    engine.add_request("gone", [7] * 30, greedy(20))
    outputs: dict[str, list[int]] = {}
    for step in range(400):
        if not engine.has_unfinished():
            break
        if step == 6:
            assert engine.abort_request("gone")
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    assert engine.stats()["num_preemptions"] > 0
    assert {rid: outputs[rid] for rid in prompts} == {rid: reference_output(p, 20, VOCAB) for rid, p in prompts.items()}
    assert sum(held(engine)) == 0
    engine.reset_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages


@pytest.mark.parametrize("error", [0.0, 0.5])
def test_speculative_rollback_keeps_the_window(error):
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=64)
    engine, _ = hybrid_engine(kv_cache_tokens=512, max_num_batched_tokens=32, speculative=spec)
    engine.proposer = OracleProposer(error, seed=7)
    rng = random.Random(9)
    prompts = {str(i): [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 40))] for i in range(4)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy(40))
    out = run_to_completion(engine)
    assert out == {rid: reference_output(p, 40, VOCAB) for rid, p in prompts.items()}
    assert engine.spec_stats.num_draft_tokens > 0


def answered_once(seed: int, length: int, max_tokens: int = 8):
    """A hybrid engine that has answered one random prompt: (engine, runner, prompt, answer)."""
    engine, runner = hybrid_engine(kv_cache_tokens=512, max_num_batched_tokens=64)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(length)]
    engine.add_request("first", prompt, greedy(max_tokens))
    return engine, runner, prompt, run_to_completion(engine)["first"]


def test_prefix_hit_needs_the_window_before_the_match():
    engine, _, first, done = answered_once(11, 41)
    tree = engine.scheduler.cache
    # 12 full pages of 48 computed tokens in the tree, and per sliding group only the pages of two
    # windows: before the prompt's last full page (positions 31..39: pages 7-9), handed over once the
    # prompt was computed, and before the end (39..47: pages 9-11), at release.
    assert tree.num_pages == 12 + 2 * 5 and tree.window_pages_held() == [5, 5]
    # The next turn extends the whole conversation: a hit up to the last full page, window and all.
    follow = first + done + [5, 6, 7]
    engine.add_request("next", follow, greedy(6))
    # A prompt sharing only the first 24 tokens: the tree has full pages there but not their window.
    partial = first[:24] + [9] * 10
    engine.add_request("partial", partial, greedy(6))
    engine.add_request("again", first, greedy(8))  # the same prompt: served up to its last full page
    outs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
        engine.check_integrity()
    assert outs["next"] == reference_output(follow, 6, VOCAB) and cached["next"] == 48
    assert outs["partial"] == reference_output(partial, 6, VOCAB) and cached["partial"] == 0
    assert outs["again"] == done and cached["again"] == 40


def test_a_repeated_prompt_copies_its_partial_page_in_every_group():
    engine, runner, first, done = answered_once(12, 43)
    # 50 positions with K/V: pages 0-11 in the tree, the sliding groups' pages 7-11 (two windows).
    engine.add_request("again", first, greedy(8))
    engine.step()
    (again,) = engine.scheduler.running
    # 10 whole pages (the window before position 40 is held), then 2 tokens of page 10, copied in
    # group 0 and in both sliding groups; the runner checks each group's window on every row.
    assert again.num_cached_tokens == 42 and again.num_tree_pages == 10
    assert [dst for _, dst in runner.copies] == [again.pages[10]] + [pages[10] for pages in again.window_pages]
    engine.check_integrity()
    assert run_to_completion(engine)["again"] == done[1:]
    engine.check_integrity()
    # A longer first answer slides the groups past page 10 (the tree gets pages 7-9 and 13-15 of
    # them): no sliding page for that position, so no copy, whole pages only.
    engine, runner, _, _ = answered_once(12, 43, max_tokens=20)
    engine.add_request("again", first, greedy(8))
    engine.step()
    assert engine.scheduler.running[0].num_cached_tokens == 40 and not runner.copies
    assert run_to_completion(engine)["again"] == done[1:]
    engine.check_integrity()


def test_samples_of_one_prompt_prefill_it_once():
    engine, _ = hybrid_engine(kv_cache_tokens=512, max_num_batched_tokens=16)
    prompt = [(7 * i) % 43 + 1 for i in range(45)]
    for k in range(3):
        engine.add_request(f"s{k}", prompt, greedy(5))
    out = run_to_completion(engine)
    assert all(out[f"s{k}"] == reference_output(prompt, 5, VOCAB) for k in range(3))
    # The first computes 45 tokens; the others match 44 // 4 * 4 = 44 and compute the last one.
    assert engine.prompt_tokens_computed_total == 45 + 2 * 1


def test_usable_prefix_rule():
    engine, _ = hybrid_engine(kv_cache_tokens=64)
    windows = engine.scheduler.windows
    # Position k * 4 needs pages from (k * 4 - 9) // 4 up to k - 1 in every group.
    have = [None, None, 10, 11, 12, None, 14]
    assert windows.usable_prefix([have, have], 7) == 5  # k = 5 needs pages 2..4; 6 and 7 a gap
    assert windows.usable_prefix([have, [None] * 2 + [1] * 5], 7) == 5
    assert windows.usable_prefix([[1, 2, 3], [1, 2, 3]], 3) == 3
    assert windows.usable_prefix([[None, 2, 3], [1, 2, 3]], 3) == 0  # position 12 still sees page 0


def test_randomized_turns_with_eviction():
    rng = random.Random(21)
    engine, runner = hybrid_engine(kv_cache_tokens=90 * PAGE, max_num_batched_tokens=24, max_num_seqs=5)
    history: list[list[int]] = []
    expected: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    hits = 0
    for i in range(150):
        if history and rng.random() < 0.5:
            prompt = rng.choice(history[-20:]) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))]
        else:
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 50))]
        prompt = prompt[-80:]
        n = rng.randint(1, 12)
        engine.add_request(str(i), prompt, greedy(n))
        expected[str(i)] = reference_output(prompt, n, VOCAB)
        history.append(prompt + expected[str(i)])
        for _ in range(rng.randint(0, 4)):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                hits += out.num_cached_tokens
            engine.check_integrity()
    for rid, toks in run_to_completion(engine).items():
        outputs.setdefault(rid, []).extend(toks)
    assert outputs == expected
    stats = engine.stats()
    assert hits > 0 and stats["kv_pages_evicted"] > 0
    assert len(runner.copies) > 3  # partial pages copied in every group, windows checked on each row
    assert engine.reset_prefix_cache() and engine.pool.num_free == engine.pool.num_pages


def test_disk_tier_is_refused_for_hybrid_models(tmp_path):
    engine, runner = hybrid_engine(kv_cache_tokens=64)
    cfg = EngineConfig(kv_cache_dir=str(tmp_path))
    with pytest.raises(InvalidRequest, match="hybrid KV"):
        attach_disk_tier(engine, cfg, runner)


def test_waiting_and_finished_requests_hold_no_sliding_pages():
    engine, _ = hybrid_engine(kv_cache_tokens=512, max_num_batched_tokens=8)
    engine.add_request("a", [2] * 30, greedy(3))
    engine.step()
    r = engine.requests["a"]
    assert r.status == RequestStatus.RUNNING and len(r.window_pages) == 2
    run_to_completion(engine)
    assert r.window_pages == [] and r.num_shared_window_pages == 0


def test_pages_per_group_reach_stats_and_metrics():
    from tokenmill.engine.engine_stats import kv_groups_list
    from tokenmill.entrypoints.openai.metrics import ServerMetrics
    from tokenmill.ipc.messages import SchedulerStats

    engine, _ = hybrid_engine(kv_cache_tokens=512, max_num_batched_tokens=64)
    engine.add_request("a", [4] * 30, greedy(20))
    for _ in range(3):
        engine.step()
    groups = kv_groups_list(engine.stats())
    r = engine.requests["a"]
    assert [g["window"] for g in groups] == [0, WINDOW, WINDOW] and [g["layers"] for g in groups] == [2, 2, 2]
    # Group 0's first 7 full pages went to the tree with the prompt; the sliding groups own their window.
    assert groups[0]["pages_in_use"] == len(r.pages) - r.num_tree_pages and groups[0]["pages_cached"] == 7
    assert groups[1]["pages_in_use"] == groups[2]["pages_in_use"] == len(engine.scheduler.windows.private(r)) // 2
    stats = SchedulerStats(num_requests_running=1, num_requests_waiting=0, kv_pages_total=128, kv_pages_in_use=9,
                           prompt_tokens_total=30, generation_tokens_total=3, prefix_cache_hit_tokens_total=0,
                           num_preemptions=0, kv_groups=groups)
    text = ServerMetrics(lambda: stats).render().decode()
    line = f'tokenmill:kv_group_pages{{group="1",state="in_use",window="{WINDOW}"}} {float(groups[1]["pages_in_use"])}'
    assert line in text
    assert 'tokenmill:kv_group_pages{group="0",state="cached",window="0"} 7.0' in text
    assert kv_groups_list(make_engine(VOCAB)[0].stats()) == []  # one group: nothing per group
