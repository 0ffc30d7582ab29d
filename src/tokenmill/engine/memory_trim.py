"""Memory of a long-running scheduler process: give freed heap back to the OS, and say where the KV
pool lives so a soak can tell the pool's resident pages from everything else.

Why: per-step tensors of varying shapes (batch rows, prefill chunk lengths, attention metadata) are
small and medium CPU allocations that glibc malloc serves from its heap and arenas; after a busy
stretch the freed space stays resident until something trims it. `HeapTrimmer` calls
`malloc_trim(0)` (which also gives back free pages inside the heap, not only at its top) each time
the engine goes from busy to idle, so a burst's memory returns when it ends, and once a minute while
it stays busy, so steady load cannot pile up free holes either (~20 ms a trim). Between trims a
process that runs steps keeps what a step frees for the next one (`keep_step_memory`: fixed mmap and
trim thresholds, measured in page faults); no other malloc setting (arenas, another allocator)
measured as helping (docs/benchmarks.md, "Memory under load", also for a jemalloc run).

The KV pool is allocated with torch.empty: its pages become resident as they are first written
(and the prefix cache keeps them), so a process's RSS grows with KV use alone. With
`TOKENMILL_KV_POOL_DIR` set, each scheduler writes its pool tensors' address ranges there as
`kv_pool-<pid>.json`; `tokenmill bench soak` subtracts the resident pages inside them (read from
/proc/PID/pagemap).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from tokenmill.glibc_heap import glibc as _glibc
from tokenmill.glibc_heap import malloc_trim

logger = logging.getLogger(__name__)

KV_POOL_DIR_ENV = "TOKENMILL_KV_POOL_DIR"
# A busy/idle flip-flop (one request at a time, back to back) trims at most this often.
MIN_TRIM_INTERVAL_S = 5.0
# Under steady load: ~20 ms once a minute (0.03% of the time).
BUSY_TRIM_INTERVAL_S = 60.0

# mallopt's parameters (malloc.h) and the values a step-running process sets (keep_step_memory).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
STEP_MMAP_THRESHOLD = 32 << 20  # glibc's largest: bigger blocks are always mapped on their own
STEP_TRIM_THRESHOLD = 128 << 20


def keep_step_memory() -> bool:
    """Keep the memory a step frees for the next step, instead of handing it to the OS at each free.

    glibc maps blocks above a threshold on their own and unmaps them on free, and gives back the
    heap's free top above another; both move with what the process frees, so a step's temporaries
    (GEMM outputs, activations, a prompt chunk's scratch) kept crossing them and every step faulted
    thousands of pages back in, ~1.3 us each on this VM: 3-9 thousand a 512-token prompt of the
    bundled model, ~2-7 % of it (docs/benchmarks.md, "A prompt's weight copies"). Fixed thresholds
    (blocks up to 32 MB from the heap, up to 128 MB of free top kept) make the second step reuse the
    first one's pages; `HeapTrimmer` still gives them back when the engine idles, and once a minute.
    Called once a model is loaded (a process's first load keeps glibc's defaults; every load ends with a
    malloc_trim). False where glibc is not the allocator."""
    if _glibc is None:
        return False
    return bool(_glibc.mallopt(M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD)
                and _glibc.mallopt(M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD))


class HeapTrimmer:
    """Calls malloc_trim once per busy -> idle transition (at most every MIN_TRIM_INTERVAL_S), and
    every BUSY_TRIM_INTERVAL_S while the engine stays busy: under steady load the engine never
    idles, and per-step tensors of ever new shapes leave free but resident holes in the heap
    (measured: +36 MB outside the KV pool over 5 minutes of a 64-stream soak without it)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._was_busy = False
        self._busy_from = 0.0  # the start of the busy stretch, or its last trim
        self._last = float("-inf")
        self.trims = 0

    def update(self, busy: bool) -> None:
        now = self._clock()
        if busy:
            if not self._was_busy:
                self._was_busy, self._busy_from = True, now
            elif now - self._busy_from >= BUSY_TRIM_INTERVAL_S:
                self._busy_from = now
                self._trim(now)
            return
        if self._was_busy and now - self._last >= MIN_TRIM_INTERVAL_S:
            self._was_busy = False
            self._trim(now)

    def _trim(self, now: float) -> None:
        self._last = now
        self.trims += 1
        malloc_trim()


def kv_pool_ranges(kv_caches: Iterable[tuple[Any, ...]]) -> list[tuple[int, int]]:
    """[start, end) byte addresses of every KV tensor (each (k, v) pair of a layer), each once: a
    hybrid KV cache's layers share tensors (kvcache/kv_groups.py)."""
    ranges = set()
    for layer in kv_caches:
        for t in layer:
            start = t.data_ptr()
            ranges.add((start, start + t.numel() * t.element_size()))
    return sorted(ranges)


def kv_pool_file(directory: str, pid: int) -> str:
    return os.path.join(directory, f"kv_pool-{pid}.json")


def write_kv_pool_map(kv_caches: Iterable[tuple[Any, ...]]) -> None:
    """Write the pool's address ranges to $TOKENMILL_KV_POOL_DIR, when set (soak benchmarks)."""
    directory = os.environ.get(KV_POOL_DIR_ENV)
    if not directory:
        return
    path = kv_pool_file(directory, os.getpid())
    ranges = kv_pool_ranges(kv_caches)
    try:
        with open(path, "w") as f:
            json.dump({"pid": os.getpid(), "bytes": sum(e - s for s, e in ranges), "ranges": ranges}, f)
    except OSError as exc:
        logger.warning("cannot write the KV pool map to %s: %s", path, exc)
