"""Scheduler and prefix-cache overhead per step, without a model (not collected by pytest).

The fake runner's forward is replaced by constant logits, so the time is the engine's own
bookkeeping: 300 requests sharing a 200-token prefix, 1-100 more prompt tokens, 10-60 output tokens,
32 running at once. Used to check that the hybrid KV cache costs models without sliding layers
nothing (docs/benchmarks.md, "Hybrid KV cache"):

    PYTHONPATH=src:. python tests/engine/bench_scheduler_overhead.py LABEL
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch

from tests.engine.fake_runner import make_engine
from tokenmill.sample.sampling_params import SamplingParams


def run() -> tuple[int, float]:
    rng = random.Random(1)
    engine, runner = make_engine(vocab_size=50, kv_cache_tokens=4096, page_size=16, max_num_batched_tokens=512,
                                 max_num_seqs=32)

    def constant_logits(chunks) -> torch.Tensor:
        out = torch.full((sum(c.num_logits if c.sample else 0 for c in chunks), 50), -10.0)
        out[:, 1] = 10.0
        return out

    runner.execute = constant_logits
    system = [rng.randrange(1, 50) for _ in range(200)]
    for i in range(300):
        engine.add_request(str(i), system + [rng.randrange(1, 50) for _ in range(rng.randint(1, 100))],
                           SamplingParams(temperature=0.0, max_tokens=rng.randint(10, 60), ignore_eos=True))
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - start


if __name__ == "__main__":
    results = [run() for _ in range(3)]
    print(sys.argv[1] if len(sys.argv) > 1 else "", "steps", results[0][0], "seconds",
          " ".join(f"{s:.3f}" for _, s in results), "load", round(os.getloadavg()[0], 1))
