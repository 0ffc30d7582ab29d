"""The API server's timeline record (frontend/request_timelines.py) and the detokenizer's durations,
without a server: each process's numbers stay in their own block, stamps of another process are dropped."""

from __future__ import annotations

import time

import pytest

from tokenmill.frontend.chat_prompt_timing import timed_chat_prompt_ids
from tokenmill.frontend.detokenizer_process import Detokenizer
from tokenmill.frontend.request_timelines import TimelineRing, frontend_view, prompt_stages, timed_prompt
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.ipc.messages import DetokenizeRequest, TextOutput, TokenBatch, TokenOutput
from tokenmill.sample.sampling_params import OutputKind, SamplingParams


@pytest.fixture
def tokenizer(smol_tokenizer: Tokenizer) -> Tokenizer:
    return smol_tokenizer  # the session's (tests/frontend/conftest.py): loading it takes seconds


def test_frontend_view_orders_every_api_stage_from_the_arrival():
    timing = timed_prompt(rendered=10.5, render_s=0.4, encode_s=0.2)
    view = frontend_view(10.0, 10.8, 11.0, 12.0, prompt_stages(10.7, timing))
    assert list(view) == ["template_rendered", "tokenized", "sent_to_scheduler", "first_text", "last_text",
                          "last_byte_sent"]
    assert [view[k] for k in list(view)[:-1]] == pytest.approx([0.5, 0.7, 0.8, 1.0, 2.0])
    assert view["last_byte_sent"] is None  # stamped later by the serving code
    completion = frontend_view(10.0, 10.8, None, None, prompt_stages(10.7))
    assert "template_rendered" not in completion and completion["tokenized"] == pytest.approx(0.7)
    assert completion["first_text"] is None


def test_a_worker_process_stamp_is_not_used_on_the_api_clock():
    timing = {**timed_prompt(rendered=123.0, render_s=0.4, encode_s=0.2), "pid": -1}  # another process
    stages = prompt_stages(10.7, timing)
    assert stages.template_rendered is None
    assert stages.tokenizer == {"template_render_s": 0.4, "encode_s": 0.2, "in_worker_process": True}
    assert frontend_view(10.0, 10.8, None, None, stages)["template_rendered"] is None


def test_ring_keeps_each_process_apart_and_stamps_the_last_byte():
    ring = TimelineRing(capacity=2)
    stages = prompt_stages(10.7, timed_prompt(10.5, 0.4, 0.2))
    for i in range(2):
        out = TextOutput(f"chat-1-{i}", "", [], True, "length", None, 3, timeline={"queue_time": 0.1},
                         detokenizer={"held_s": 0.9, "busy_s": 0.01})
        ring.finished(frontend_view(10.0, 10.8, 11.0, 12.0, stages), out, stages)
    ring.last_byte_sent("chat-1", 2.5)
    for i in range(2):
        record = ring.get(f"chat-1-{i}")
        assert record["frontend"]["last_byte_sent"] == 2.5 and record["finish_reason"] == "length"
        assert record["detokenizer"] == {"held_s": 0.9, "busy_s": 0.01} and record["engine"] == {"queue_time": 0.1}
        assert record["tokenizer"]["in_worker_process"] is False
    ring.last_byte_sent("unknown", 1.0)  # a request that failed before finishing: nothing to stamp
    ring.finished(frontend_view(0.0, 0.1, 0.2, 0.3), TextOutput("c-0", "", [], True, "stop", None, 1))
    assert ring.get("chat-1-0") is None and ring.get("c-0")["detokenizer"] is None  # bounded; none sent


def test_chat_prompt_timing_matches_the_template_path(tokenizer):
    messages = [{"role": "user", "content": "Hello there"}]
    before = time.monotonic()
    ids, timing = timed_chat_prompt_ids(tokenizer, messages, 8192)
    assert ids == tokenizer.apply_chat_template(messages)
    assert before <= timing["rendered"] <= time.monotonic()
    assert timing["render_s"] > 0 and timing["encode_s"] > 0
    assert prompt_stages(time.monotonic(), timing).template_rendered == timing["rendered"]


def test_detokenizer_reports_how_long_it_held_the_request(tokenizer):
    detok = Detokenizer(tokenizer)
    detok.handle(DetokenizeRequest("r", [1], SamplingParams(output_kind=OutputKind.DELTA)))
    ids = tokenizer.encode(" one two")
    first, _ = detok.handle(TokenBatch([TokenOutput("r", ids[:1], False, None, None)]))
    time.sleep(0.02)
    last, _ = detok.handle(TokenBatch([TokenOutput("r", ids[1:], True, "length", None)]))
    assert first[0].detokenizer is None  # only the last text carries it
    held, busy = last[0].detokenizer["held_s"], last[0].detokenizer["busy_s"]
    assert held >= 0.02 and 0 < busy < held
