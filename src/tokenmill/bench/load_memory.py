"""`tokenmill bench load-memory`: the resident memory of a model loaded as `LLM(file)` does, by stage.

Issue 23's target: `LLM(file)` resident in at most 1.1 x the file + ~150 MB (Gemma 3 270M: 428 MB).
The command loads the model in this (fresh) process the way `LLM` does - the engine core (weights,
runner, KV pool), then the tokenizer, then a heap trim - and generates a few tokens, reading /proc/self/status after
each stage: VmRSS (resident now), VmHWM (the peak so far), and RssAnon / RssFile (private memory
against pages of mapped files such as the GGUF), so a regression shows at the stage that caused it.

The verdict counts the bound as issue 22 measured its own figures ("RSS growth of `LLM(file)` after
one request"): resident memory after the generation minus after the imports, since the ~150 MB of
runtime the bound allows are the tokenizer, threads and first KV pages, not the interpreter and
torch (whose import alone is ~210 MB here). The whole process against the bound is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from tokenmill.entrypoints.engine_args import add_engine_args, engine_kwargs
from tokenmill.model.gguf_parts import all_parts

MB = 2**20
_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def add_load_memory_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("load-memory", help="resident memory of a loaded model by load stage (LLM(file))")
    p.add_argument("--generate-tokens", type=int, default=8, help="tokens generated after the load (0: none)")
    p.add_argument("--json", metavar="PATH", default=None, help="write settings and results here")
    add_engine_args(p)
    p.set_defaults(func=cmd_load_memory)


def process_memory() -> dict[str, float]:
    """This process's VmRSS, VmHWM, RssAnon and RssFile in MB (Linux /proc)."""
    out: dict[str, float] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _FIELDS:
                out[key] = int(value.split()[0]) * 1024 / MB
    return out


def target_mb(file_bytes: int) -> float:
    """Issue 23's bound: 1.1 x the file + ~150 MB."""
    return 1.1 * file_bytes / MB + 150.0


def cmd_load_memory(args: argparse.Namespace) -> int:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.factory import build_engine_core
    from tokenmill.engine.memory_trim import malloc_trim
    from tokenmill.frontend.tokenizer import Tokenizer
    from tokenmill.model.default_model import default_model_path
    from tokenmill.sample.sampling_params import SamplingParams

    model = os.path.abspath(os.path.expanduser(args.model)) if args.model else default_model_path()
    stages: list[dict[str, Any]] = [{"stage": "imports", **process_memory()}]
    start = time.monotonic()
    # The two steps of LLM.__init__ (entrypoints/llm_in_process.py), each measured.
    engine = build_engine_core(EngineConfig.from_kwargs(model=model, **engine_kwargs(args)))
    stages.append({"stage": "engine core (weights, runner)", **process_memory(), "s": time.monotonic() - start})
    began = time.monotonic()
    # Built in the export child, or read from the cache (model/tokenizer_export.py); which one shows
    # in its seconds (TOKENMILL_TOKENIZER_CACHE=0: always the child, the first run's cost).
    tokenizer = Tokenizer.from_model_path(model)
    stages.append({"stage": "tokenizer", **process_memory(), "s": time.monotonic() - began})
    malloc_trim()  # as LLM.__init__ ends
    stages.append({"stage": "heap trimmed (LLM.__init__ done)", **process_memory()})
    loaded = time.monotonic() - start
    transformers_loaded = "transformers" in sys.modules
    if args.generate_tokens > 0:
        ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
        engine.add_request("m", ids, SamplingParams(temperature=0.0, max_tokens=args.generate_tokens, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        stages.append({"stage": f"generated {args.generate_tokens} tokens", **process_memory()})
    size = sum(os.path.getsize(p) for p in all_parts(model)) if os.path.isfile(model) else sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(model) for f in files)
    bound = target_mb(size)
    weights = engine.runner.model.weight_bytes() / MB
    print(f"{model}: {size / MB:.0f} MB file, weights held {weights:.0f} MB, loaded in {loaded:.1f} s "
          f"(load {os.getloadavg()[0]:.2f})")
    print(f"  {'stage':36s} {'VmRSS':>8s} {'VmHWM':>8s} {'RssAnon':>8s} {'RssFile':>8s}  (MB)  seconds")
    for s in stages:
        took = f"  {s['s']:6.1f}" if "s" in s else ""
        print(f"  {s['stage']:36s} " + " ".join(f"{s.get(k, 0.0):8.0f}" for k in _FIELDS) + took)
    print(f"  transformers imported by the load: {'yes' if transformers_loaded else 'no'}")
    final = stages[-1]["VmRSS"]
    growth = final - stages[0]["VmRSS"]
    print(f"  target 1.1 x file + 150 MB = {bound:.0f} MB of growth over the imports: "
          f"{'met' if growth <= bound else 'not met'} (+{growth:.0f} MB = {growth / bound:.2f} x the target; "
          f"the whole process {final:.0f} MB = {final / bound:.2f} x, peak {stages[-1]['VmHWM']:.0f} MB)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"settings": vars(args) | {"func": None}, "file_mb": size / MB, "weights_mb": weights,
                       "target_mb": bound, "growth_mb": growth, "growth_to_target": growth / bound,
                       "ratio_to_target": final / bound, "stages": stages,
                       "transformers_imported": transformers_loaded}, f, indent=1, default=str)
    return 0
