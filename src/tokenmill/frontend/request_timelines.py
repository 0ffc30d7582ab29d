"""The API server's record of where recent requests spent their time: `GET /v1/requests/{id}/timeline`.

Two views of a sequence, each measured within one process and never mixed: the API process's own
(from the HTTP arrival: sent to the scheduler, i.e. template + tokenization; first text; last text)
and the engine's (engine/timeline.py: queue, each prefill chunk, preemptions, first token,
finish), which arrives with the sequence's last output, or just after it when a stop string ended
the text first. Finished sequences are kept in a bounded ring (the last MAX_FINISHED); running ones
are read from the manager's live state.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

MAX_FINISHED = 1000


def frontend_view(arrival: float, sent: float | None, first: float | None, last: float | None) -> dict[str, Any]:
    """Seconds since the HTTP arrival at each stage the API process saw (None: not reached yet)."""

    def since(t: float | None) -> float | None:
        return None if t is None else t - arrival

    return {"sent_to_scheduler": since(sent), "first_text": since(first), "last_text": since(last)}


class TimelineRing:
    def __init__(self, capacity: int = MAX_FINISHED) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def finished(self, seq_id: str, frontend: dict[str, Any], finish_reason: str | None,
                 engine: dict[str, Any] | None) -> None:
        record = self._records.pop(seq_id, None) or {"id": seq_id, "engine": None}
        record.update(status="finished", finish_reason=finish_reason, frontend=frontend,
                      finished_at=time.time())
        if engine is not None:
            record["engine"] = engine
        self._put(seq_id, record)

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
