"""What the live dashboard costs the scheduler process: building and encoding one stats message
(every 0.25 s while busy), StepStats per engine step, and the radix tree's shared-prefix walk (every
2 s at most). Not a test: `PYTHONPATH=. .venv/bin/python tests/browser/dashboard_overhead.py`
(figures in docs/benchmarks.md)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import msgspec

from tests.engine.fake_runner import make_engine
from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.engine.scheduler_process import SchedulerLoop
from tokenmill.engine.step_stats import StepStats
from tokenmill.kvcache.page_pool import PagePool
from tokenmill.kvcache.radix_cache import RadixCache
from tokenmill.sample.sampling_params import SamplingParams


def best(f: Callable[[], object], n: int) -> float:
    """Seconds per call, the best of 5 rounds of n calls."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            f()
        rounds.append((time.perf_counter() - start) / n)
    return min(rounds)


class EncodingSink:
    def send(self, message: object) -> None:
        msgspec.msgpack.encode(message)


def main() -> None:
    rng = random.Random(0)
    # 64 running (the batch cap), 200 waiting: the stats message reads both.
    engine, _ = make_engine(kv_cache_tokens=65536, page_size=16, max_num_batched_tokens=2048, max_num_seqs=64)
    for i in range(264):
        prompt = [rng.randrange(1, 50) for _ in range(100)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(6):
        engine.step()
    loop = SchedulerLoop(engine, None, None, EncodingSink())  # type: ignore[arg-type]
    print(f"{len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting")
    print(f"stats message (stats() + SchedulerStats + msgpack): {best(lambda: loop.maybe_send_stats(True), 200) * 1e6:.0f} us")
    print(f"engine.stats() alone: {best(engine.stats, 200) * 1e6:.0f} us")

    steps = StepStats(2048)
    chunks = [ScheduledChunk(r, 1) for r in engine.scheduler.running]

    def step() -> None:
        steps.begin()
        steps.end(chunks)

    print(f"StepStats begin + end, {len(chunks)} decode rows: {best(step, 2000) * 1e6:.1f} us")

    # A system prompt of 2 pages, then distinct 4-page continuations until the pool is full.
    for num_pages in (4096, 65536):
        pool = PagePool(num_pages + 10, 16)
        cache = RadixCache(pool)
        system = list(range(1000, 1032))
        while pool.num_free >= 6:
            cache.insert(system + [rng.randrange(1, 50000) for _ in range(64)], pool.allocate(6))
        print(f"shared_prefixes, {cache.num_pages} cached pages: {best(cache.shared_prefixes, 5) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
