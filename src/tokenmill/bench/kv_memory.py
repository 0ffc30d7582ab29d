"""`tokenmill bench kv-memory`: the KV bytes one long request holds, per KV group.

Issue 23's target for the hybrid KV cache (kvcache/kv_groups.py): a 16k-token request on Gemma 3
270M should hold what 3 full layers plus 15 sliding windows need (~55 MB in bf16), not 18 full
layers (~290 MB). The command runs one random-token prompt of `--prompt-len` tokens through the
engine, lets it decode two tokens (so the step after the prompt has freed what left the window),
and counts the pages the request points at in each group, its own and the prefix tree's, times
what a page costs in the pool. `--full-kv` runs the same with every layer's KV for the whole
context (the cache before the hybrid layout), for the comparison on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

from tokenmill.bench.arg_types import at_least
from tokenmill.entrypoints.engine_args import add_engine_args, engine_kwargs


def add_kv_memory_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("kv-memory", help="KV bytes one long request holds, per KV group (hybrid KV cache)")
    p.add_argument("--prompt-len", type=at_least(16), default=16384)
    p.add_argument("--full-kv", action="store_true", help="every layer keeps its KV for the whole context")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="write settings and results here")
    add_engine_args(p)
    p.set_defaults(func=cmd_kv_memory)


def cmd_kv_memory(args: argparse.Namespace) -> int:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.factory import build_engine_core
    from tokenmill.sample.sampling_params import SamplingParams

    kwargs = engine_kwargs(args)
    kwargs["kv_cache_tokens"] = max(kwargs["kv_cache_tokens"], args.prompt_len + 1024)
    config = EngineConfig.from_kwargs(model=args.model, hybrid_kv_cache=not args.full_kv, **kwargs)
    engine = build_engine_core(config)
    rng = random.Random(args.workload_seed)
    prompt = [rng.randrange(1000, min(engine.vocab_size, 30000)) for _ in range(args.prompt_len)]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.monotonic()
    request = engine.requests["long"]
    while len(request.output_token_ids) < 2:
        engine.step()
    elapsed = time.monotonic() - start
    result = request_kv_bytes(engine, request)
    result.update(prompt_len=args.prompt_len, full_kv=args.full_kv, seconds=round(elapsed, 1),
                  load=round(os.getloadavg()[0], 2), kv_cache_dtype=engine.runner.kv_format.name)
    print(f"{args.prompt_len} prompt tokens + 2 decoded, {result['kv_cache_dtype']} KV, "
          f"{'full KV for every layer' if args.full_kv else 'hybrid KV groups'} ({elapsed:.0f} s, load {result['load']}):")
    for g in result["groups"]:
        window = f"window {g['window']}" if g["window"] else "full attention"
        print(f"  group {g['group']}: {g['layers']:2d} layers, {window:14s} {g['pages']:6d} pages  "
              f"{g['bytes'] / 2**20:8.2f} MiB")
    print(f"  total {result['bytes'] / 2**20:.2f} MiB held by the request "
          f"({result['bytes_per_page']} bytes a page of {engine.pool.page_size} tokens)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"settings": vars(args) | {"func": None}, "result": result}, f, indent=1, default=str)
    return 0


def request_kv_bytes(engine: Any, request: Any) -> dict:
    """The pages `request` points at in each KV group (its own and the tree's) and their bytes."""
    layout = engine.runner.kv_layout
    bytes_per_page = engine.runner.kv_bytes_per_token * engine.pool.page_size  # one slot of every tensor
    pages = [len(request.pages)] + [sum(p is not None for p in group) for group in request.window_pages]
    groups = [{"group": g, "layers": len(group.layers), "window": group.window or 0, "pages": n,
               "bytes": n * bytes_per_page} for g, (group, n) in enumerate(zip(layout.groups, pages))]
    return {"groups": groups, "bytes": sum(g["bytes"] for g in groups), "bytes_per_page": bytes_per_page}
