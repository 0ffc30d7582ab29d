"""Find stop strings in streamed text, and hold back only what could still turn into one.

Which match wins: the one that *completes* first in the text (smallest end; on a tie, the one
starting first, i.e. the longest). That is where generation would stop if text arrived one character
at a time, so the result does not depend on how the text is cut into deltas (tokens, held UTF-8
bytes, multi-token steps), and list order never matters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    text: str  # safe to show now: never past a stop, never a cut stop string or the start of one
    stopped: bool = False
    stop_reason: str | None = None  # the stop string that matched


class StopChecker:
    """Per request. Each feed() searches only the new text plus the last max_len-1 characters."""

    def __init__(self, stop_strings: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in dict.fromkeys(stop_strings) if s]
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._tail = ""  # the last max_len-1 characters fed, to find stops that span deltas
        self._held = 0  # how many characters at the end of _tail have not been returned yet
        self._stop_reason: str | None = None

    @property
    def has_stops(self) -> bool:
        return bool(self._stops)

    @property
    def stopped(self) -> bool:
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    @property
    def held_text(self) -> str:
        return self._tail[len(self._tail) - self._held :]

    def feed(self, delta: str, *, can_stop: bool = True) -> StopResult:
        """Add new text. can_stop=False: stop strings that complete inside this delta do not count
        (min_tokens); text is still held back, since a stop may start here and complete later."""
        if self._stop_reason is not None:
            return StopResult("", True, self._stop_reason)
        if not self._stops:
            return StopResult(delta)
        buf = self._tail + delta
        done = len(buf) - len(delta) - self._held  # characters of buf already returned
        if can_stop and delta and (match := self._first_completed(buf, len(buf) - len(delta))):
            start, stop = match
            self._stop_reason, self._tail, self._held = stop, "", 0
            end = start + len(stop) if self._include else start
            return StopResult(buf[done:end] if end > done else "", True, stop)
        hold = 0 if self._include else self._longest_pending(buf)
        self._tail = buf[max(0, len(buf) - self._max_len + 1) :] if self._max_len > 1 else ""
        self._held = hold
        return StopResult(buf[done : len(buf) - hold])

    def flush(self) -> str:
        """The request ends for another reason (length, EOS, abort): release the held text."""
        text = self.held_text if self._stop_reason is None else ""
        self._held = 0
        return text

    def _first_completed(self, buf: str, new_from: int) -> tuple[int, str] | None:
        # Only matches ending in the new text count: earlier ones were checked before (or were in
        # text that could not stop, for min_tokens). A stop's first occurrence is also its first end.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _longest_pending(self, buf: str) -> int:
        # The longest end of the text that is a proper prefix of a stop string may still become one.
        # Per stop, only the positions of its first character in its last len - 1 characters can start
        # one, and the leftmost that does is the longest: C-speed scans, memory linear in the lengths
        # (a set of every prefix was quadratic: one 400 kB stop string took the detokenizer to 23 GB).
        n, best = len(buf), 0
        for stop in self._stops:
            at = buf.find(stop[0], max(0, n - len(stop) + 1))
            while at >= 0 and n - at > best:
                if stop.startswith(buf[at:]):
                    best = n - at
                    break
                at = buf.find(stop[0], at + 1)
        return best
