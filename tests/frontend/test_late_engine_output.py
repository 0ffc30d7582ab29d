"""A text ended by a stop string is finished on the API side before the engine stops: the engine's last
output for it comes after, with no tokens, a count of 0 and its timeline. It must change no count: it
once replaced a streamed completion's usage with 0 when it arrived while the request's consumer was busy
(merged with the real last output) or still reading another of its sequences (n > 1)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tokenmill.frontend.sequences import SeqState
from tokenmill.frontend.tokenizer_manager import TokenizerManager
from tokenmill.ipc.messages import TextBatch, TextOutput


def test_the_engines_last_output_after_a_stop_string_only_fills_the_record():
    queue: asyncio.Queue = asyncio.Queue()
    state = SeqState(queue, 0, arrival=0.0, record=False)
    engine_records: list[tuple[str, dict]] = []
    manager = SimpleNamespace(
        _states={"r-0": state}, last_text_time=None,
        timelines=SimpleNamespace(engine=lambda rid, timeline: engine_records.append((rid, timeline))),
    )
    manager._deliver = lambda st, out, now: TokenizerManager._deliver(manager, st, out, now)
    final = TextOutput("r-0", " Paris", [3, 4], True, "stop", "\n", 13)
    late = TextOutput("r-0", "", [], True, "stop", None, 0, timeline={"steps": 14})
    TokenizerManager._dispatch(manager, TextBatch([final, late]))  # type: ignore[arg-type]
    assert [queue.get_nowait() for _ in range(queue.qsize())] == [(0, final)]
    assert state.finished and state.num_output_tokens == 13
    assert engine_records == [("r-0", {"steps": 14})]
