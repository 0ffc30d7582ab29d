"""`tokenmill bench disk-tier`: what the prefix cache's disk tier saves, as time to first token.

Three timings of one long random-token prompt (max_tokens=1, so the time is the prefill plus one
step): cold (nothing cached), after the pool evicted it (`reset_prefix_cache`: the pages come back
from `--kv-cache-dir`), and from a new engine on the same folder (a restart). The tier's folder is a
fresh temporary one unless given, so the cold run is cold. Targets (issue 26): both warm TTFTs at
most a quarter of the cold one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

from tokenmill.bench.arg_types import at_least
from tokenmill.bench.common import run_settings
from tokenmill.entrypoints.engine_args import add_engine_args, engine_kwargs


def add_disk_tier_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("disk-tier", help="TTFT of a long prompt: cold, from the KV disk tier, after a restart")
    p.add_argument("--prompt-len", type=at_least(16), default=4096)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="write settings and results here")
    add_engine_args(p)
    p.set_defaults(func=cmd_disk_tier)


def cmd_disk_tier(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sample.sampling_params import SamplingParams

    kwargs = engine_kwargs(args)
    kwargs["kv_cache_tokens"] = max(kwargs["kv_cache_tokens"], 2 * args.prompt_len)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    with tempfile.TemporaryDirectory(prefix="tokenmill-kv-") as scratch:
        kwargs["kv_cache_dir"] = kwargs["kv_cache_dir"] or scratch
        llm = LLM(args.model, **kwargs)
        vocab = llm.engine.vocab_size
        rng = random.Random(args.workload_seed)
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        llm.generate([{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(64)]}], one)  # warm-up

        def ttft(engine: Any) -> float:
            start = time.perf_counter()
            engine.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
            return time.perf_counter() - start

        cold = ttft(llm)
        llm.engine.scheduler.offload.tier.flush()
        llm.reset_prefix_cache()
        evicted = ttft(llm)
        hits = llm.stats()["kv_disk_hit_pages_total"]
        llm.shutdown()
        del llm
        restarted_llm = LLM(args.model, **kwargs)
        restarted = ttft(restarted_llm)
        restart_hits = restarted_llm.stats()["kv_disk_hit_pages_total"]
        restarted_llm.shutdown()
    result = {
        "settings": {**run_settings(kwargs.get("num_threads") or os.cpu_count() or 1), "prompt_len": args.prompt_len,
                     "model": args.model},
        "cold_ttft_s": cold, "evicted_ttft_s": evicted, "restarted_ttft_s": restarted,
        "evicted_pages_from_disk": hits, "restarted_pages_from_disk": restart_hits,
        "evicted_ratio": evicted / cold, "restarted_ratio": restarted / cold,
    }
    print(f"{args.prompt_len}-token prompt, TTFT: cold {cold * 1e3:.0f} ms, evicted -> disk {evicted * 1e3:.0f} ms "
          f"({evicted / cold:.2f}x, {hits} pages read), after a restart {restarted * 1e3:.0f} ms "
          f"({restarted / cold:.2f}x, {restart_hits} pages read); target <= 0.25x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ok = result["evicted_ratio"] <= 0.25 and result["restarted_ratio"] <= 0.25
    print("PASS" if ok else "FAIL", file=sys.stderr)
    return 0
