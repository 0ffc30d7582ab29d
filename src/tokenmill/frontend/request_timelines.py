"""The API server's record of where recent requests spent their time: `GET /v1/requests/{id}/timeline`.

Each process reports what it measured on its own clock, and no two clocks are ever subtracted:

- `frontend`, the API process, in seconds since the HTTP arrival: `template_rendered` (chat only),
  `tokenized`, `sent_to_scheduler`, `first_text`, `last_text`, `last_byte_sent` (the response's last
  chunk, or its whole JSON body, handed to the HTTP server).
- `tokenizer`, chat only: seconds spent rendering the template and encoding it, measured where that
  ran (a thread of the API process, or a --tokenizer-workers process; then `template_rendered` is
  None, since the worker's clock is not the API process's).
- `detokenizer`, the detokenizer process: `held_s`, from learning of the sequence to sending its last
  text, and `busy_s`, the part of it spent detokenizing and matching stop strings.
- `engine`, the scheduler process (engine/timeline.py): queue, each prefill chunk, preemptions, first
  token, finish; it arrives with the sequence's last output, or just after it when a stop string
  ended the text first.

Finished sequences are kept in a bounded ring (the last MAX_FINISHED); running ones are read from the
manager's live state.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenmill.ipc.messages import TextOutput

MAX_FINISHED = 1000


@dataclass
class PromptStages:
    """What happened to a request before it was sent: the API process's monotonic stamps, and, for a
    chat, the tokenizer's own durations (`tokenizer` above)."""

    tokenized: float | None = None
    template_rendered: float | None = None
    tokenizer: dict[str, Any] | None = None  # None: no template (a completion)


def timed_prompt(rendered: float, render_s: float, encode_s: float) -> dict[str, Any]:
    """What a chat's tokenizing function reports back (called where it ran, on that process's clock)."""
    return {"pid": os.getpid(), "rendered": rendered, "render_s": render_s, "encode_s": encode_s}


def prompt_stages(tokenized: float, timing: dict[str, Any] | None = None) -> PromptStages:
    """The stamps of a request tokenized at `tokenized` (API clock); `timing` from timed_prompt for a chat."""
    if timing is None:
        return PromptStages(tokenized)
    here = timing["pid"] == os.getpid()  # a worker process's monotonic stamp means nothing here
    return PromptStages(tokenized, timing["rendered"] if here else None,
                        {"template_render_s": timing["render_s"], "encode_s": timing["encode_s"],
                         "in_worker_process": not here})


def frontend_view(arrival: float, sent: float | None, first: float | None, last: float | None,
                  stages: PromptStages | None = None) -> dict[str, Any]:
    """Seconds since the HTTP arrival at each stage the API process saw (None: not reached yet)."""

    def since(t: float | None) -> float | None:
        return None if t is None else t - arrival

    view: dict[str, Any] = {}
    if stages is not None and stages.tokenizer is not None:
        view["template_rendered"] = since(stages.template_rendered)
    view["tokenized"] = since(stages.tokenized if stages is not None else None)
    view.update(sent_to_scheduler=since(sent), first_text=since(first), last_text=since(last), last_byte_sent=None)
    return view


class TimelineRing:
    def __init__(self, capacity: int = MAX_FINISHED) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def finished(self, frontend: dict[str, Any], out: TextOutput, stages: PromptStages | None = None) -> None:
        """`out`: the sequence's last text, with the detokenizer's and (usually) the engine's records."""
        record = self._records.pop(out.request_id, None) or {"id": out.request_id, "engine": None}
        record.update(status="finished", finish_reason=out.finish_reason, frontend=frontend,
                      finished_at=time.time(), detokenizer=out.detokenizer)
        if stages is not None and stages.tokenizer is not None:
            record["tokenizer"] = stages.tokenizer
        if out.timeline is not None:
            record["engine"] = out.timeline
        self._put(out.request_id, record)

    def last_byte_sent(self, request_id: str, since_arrival: float) -> None:
        """The response's end went to the HTTP server `since_arrival` seconds after the request came
        (the serving code stamps it: the manager's part ends with the last text)."""
        for i in itertools.count():
            record = self._records.get(f"{request_id}-{i}")
            if record is None:
                return
            record["frontend"]["last_byte_sent"] = since_arrival

    def engine(self, seq_id: str, timeline: dict[str, Any]) -> None:
        """The engine's timeline of a sequence whose text already finished (a stop string)."""
        record = self._records.get(seq_id)
        if record is not None:
            record["engine"] = timeline

    def get(self, seq_id: str) -> dict[str, Any] | None:
        return self._records.get(seq_id)

    def _put(self, seq_id: str, record: dict[str, Any]) -> None:
        self._records[seq_id] = record
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)
