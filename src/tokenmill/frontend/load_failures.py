"""Failed model loads, remembered for a while, so that retries answer at once and touch nothing.

Why: a model file that cannot load fails the same way on every try. Without a memory, each retry
(a client's retry loop, a health probe naming the model) runs the checks or starts processes again,
and, with a full pool, made room for it first: unloading healthy models for a load that then failed.
A failure is keyed by the file's identity (size and mtime: model/file_stamp.py), so a fixed or
replaced file is tried again at once; it is forgotten after `FAILED_LOAD_TTL_S`, so a cause outside the file (memory, a killed process) gets another chance.

Pure bookkeeping: `now` is passed in (model_pool.py applies it; the unit tests drive the clock).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.model.file_stamp import FileStamp

FAILED_LOAD_TTL_S = 60.0


@dataclass(frozen=True)
class FailedLoad:
    stamp: FileStamp
    until: float  # monotonic seconds after which the load is tried again
    reason: str  # the cause, in the loader's words (what the client is told)


class LoadFailures:
    """The last failed load of each model, by name."""

    def __init__(self, ttl_s: float = FAILED_LOAD_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._failed: dict[str, FailedLoad] = {}

    def remember(self, name: str, stamp: FileStamp, reason: str, now: float) -> None:
        self._failed[name] = FailedLoad(stamp, now + self.ttl_s, reason)

    def recall(self, name: str, stamp: FileStamp, now: float) -> str | None:
        """The reason the last load failed, if it failed on this very file less than ttl_s ago."""
        failed = self._failed.get(name)
        if failed is None:
            return None
        if failed.stamp != stamp or now >= failed.until:
            del self._failed[name]
            return None
        return failed.reason

    def forget(self, name: str) -> None:
        self._failed.pop(name, None)
