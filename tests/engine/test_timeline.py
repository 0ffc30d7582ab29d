"""Request timelines (engine/timeline.py): a request that was chunked, preempted and resumed reports
its stages in order, its prefill chunks add up to what it computed, and the summary's numbers agree
with the events; only the finished output carries it."""

from __future__ import annotations

import random

from tests.engine.fake_runner import make_engine, reference_output
from tokenmill.engine.timeline import MAX_EVENTS, RequestTimeline
from tokenmill.sample.sampling_params import SamplingParams


def test_a_chunked_preempted_and_resumed_request_reports_every_stage():
    rng = random.Random(3)
    # 12 pages of 4 tokens for 6 requests of ~20-30 tokens each: preemptions; 8 tokens a step: chunks.
    engine, _ = make_engine(kv_cache_tokens=48, page_size=4, max_num_batched_tokens=8)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(10, 18))] for _ in range(6)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    timelines, outputs = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert (out.timeline is not None) == out.finished  # only the last output carries it
            if out.finished:
                timelines[out.request_id] = out.timeline
    assert all(outputs[str(i)] == reference_output(p, 12) for i, p in enumerate(prompts))

    preempted = [rid for rid, t in timelines.items() if t["num_preemptions"] > 0]
    assert preempted, "the pool is too small for all six at once: some request must be preempted"
    for rid, t in timelines.items():
        events = t["events"]
        stages = [e["stage"] for e in events]
        assert stages[0] == "arrived" and stages[-1] == "finished" and events[-1]["reason"] == "length"
        assert all(a["at"] <= b["at"] for a, b in zip(events, events[1:]))  # one clock, in order
        assert stages.count("first_token") == 1
        prompt_len = len(prompts[int(rid)])
        # Before the first token the prompt was computed in chunks of at most the token budget.
        first = stages.index("first_token")
        before = [e["tokens"] for e in events[:first] if e["stage"] == "prefill_chunk"]
        cached = events[stages.index("scheduled")]["tokens"]
        assert sum(before) + cached >= prompt_len - 1  # (a last chunk of one token computes like a decode row)
        assert len(before) >= 2 and all(n <= 8 for n in before)  # chunked
        assert t["num_prefill_chunks"] == stages.count("prefill_chunk")
        assert t["num_output_tokens"] == 12
        assert t["queue_time"] == events[stages.index("scheduled")]["at"] >= 0
        assert t["first_token_latency"] == events[first]["at"]
        assert t["prefill_time"] == t["first_token_latency"] - t["queue_time"]
        assert t["decode_throughput"] > 0
    for rid in preempted:
        stages = [e["stage"] for e in timelines[rid]["events"]]
        cut = stages.index("preempted")
        # re-admitted: what the prefix cache kept of its pages, then the rest recomputed in chunks
        again = stages.index("scheduled", cut)
        events = timelines[rid]["events"]
        recomputed = events[again]["tokens"] + sum(e["tokens"] for e in events[again:] if e["stage"] == "prefill_chunk")
        assert recomputed >= len(prompts[int(rid)]) - 1
        assert stages.count("scheduled") == timelines[rid]["num_preemptions"] + 1


def test_the_event_list_is_bounded():
    t = RequestTimeline(arrival=0.0)
    for _ in range(3 * MAX_EVENTS):
        t.add("preempted", now=1.0)
        t.add("scheduled", now=2.0)
    assert len(t.events) == MAX_EVENTS and t.dropped == 6 * MAX_EVENTS - (MAX_EVENTS - 1)
    assert t.summary()["queue_time"] == 2.0 and t.summary()["first_token_latency"] is None
