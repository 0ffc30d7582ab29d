"""Latency over a sliding window, for the live dashboard: TTFT and inter-token latency percentiles, and
the slowest recently finished sequences.

The API process already sees every output arrive (TokenizerManager._deliver); this keeps what it saw
in bounded deques (time-stamped on this process's monotonic clock, the same clock the arrival was
taken on) and answers percentiles only when asked, at the dashboard's cadence. Prometheus histograms
(/metrics) count since start-up and cannot forget; this forgets after `window_s`.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from tokenmill.ipc.messages import TextOutput

WINDOW_S = 60.0
# Per series. At 16 streams x 40 tokens/s the inter-token deque holds ~30 s rather than 60: the
# bound keeps memory and the sort at read time small whatever the load.
MAX_SAMPLES = 20_000


class FinishedSeq(NamedTuple):
    at: float  # monotonic, when the last output arrived
    e2e_s: float  # HTTP arrival to last output
    seq_id: str
    finish_reason: str | None
    output_tokens: int


class LiveLatency:
    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._itl: deque[tuple[float, float, int]] = deque(maxlen=max_samples)  # (at, seconds, tokens)
        self._finished: deque[FinishedSeq] = deque(maxlen=max_samples)

    def observe(self, out: TextOutput, now: float, arrival: float, last_time: float | None) -> None:
        """One output of a recorded sequence (health probes stay out), before the state is updated:
        `last_time` is when its previous tokens arrived (None: these are its first)."""
        n = len(out.token_ids)
        if n:
            if last_time is None:
                self._ttft.append((now, now - arrival))
            else:
                self._itl.append((now, (now - last_time) / n, n))
        if out.finished:
            self._finished.append(FinishedSeq(now, now - arrival, out.request_id, out.finish_reason,
                                              out.num_output_tokens))

    def summary(self, slowest: int = 5) -> dict[str, Any]:
        """Percentiles of the window and its `slowest` sequences (longest end-to-end first)."""
        since = self.clock() - self.window_s
        for series in (self._ttft, self._itl, self._finished):
            while series and series[0][0] < since:
                series.popleft()
        return {
            "window_s": self.window_s,
            "ttft": percentiles((v, 1) for _, v in self._ttft),
            "itl": percentiles((v, n) for _, v, n in self._itl),
            "e2e": percentiles((f.e2e_s, 1) for f in self._finished),
            "slowest": heapq.nlargest(slowest, self._finished, key=lambda f: f.e2e_s),
        }


def percentiles(samples: Iterable[tuple[float, int]], qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, Any]:
    """Weighted nearest-rank percentiles (an inter-token sample of k tokens counts k times)."""
    ordered = sorted(samples)
    total = sum(w for _, w in ordered)
    out: dict[str, Any] = {"count": total}
    if not ordered:
        return out | {f"p{round(q * 100)}": None for q in qs} | {"max": None}
    targets = iter([(q, max(1.0, q * total)) for q in qs])
    q, target = next(targets)
    seen = 0
    for value, weight in ordered:
        seen += weight
        while seen >= target:
            out[f"p{round(q * 100)}"] = value
            nxt = next(targets, None)
            if nxt is None:
                return out | {"max": ordered[-1][0]}
            q, target = nxt
    return out | {"max": ordered[-1][0]}
