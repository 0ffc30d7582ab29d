"""`tokenmill bench moe-decode`: batch-1 decode CPU time per step and resident memory of a MoE file.

Issue 24's two missed targets, measured so that a shared machine barely moves them:
- speed: the process CPU time of a batch-1 decode step at 1 thread (what load changes least), and
  the wall time per step at the requested thread counts, over the engine's runner directly (one
  SeqChunk a step, greedy), split into the fused layer stack and the rest (lm_head, sampling, Python);
- memory (`--memory`): RSS of `LLM(file)` after a generation, split into the runtime (RSS after the
  imports), the KV pool's resident pages, the weights' resident pages and the rest, against the
  file's size: the target is RSS <= 1.1 x file + runtime + KV.
The wall-clock ratio to llama.cpp is `tokenmill bench latency --peer llama.cpp`'s job.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

MB = 2**20


def add_moe_decode_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("moe-decode", help="batch-1 decode CPU time per step and RSS of a MoE file",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF (e.g. `tokenmill bench make-moe`'s)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--steps", type=int, default=64, help="decode steps a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--memory", action="store_true", help="measure RSS of LLM(file) instead (2 threads)")
    p.set_defaults(func=cmd_moe_decode)


def cmd_moe_decode(args: argparse.Namespace) -> int:
    if args.memory:
        report = measure_memory(args.model)
        for stage, figures in report["stages"].items():
            print(f"{stage:16s} " + "  ".join(f"{k} {v:7.1f}" for k, v in figures.items()) + " MiB")
        print(f"file {report['file']:.1f} MiB; RSS - runtime - KV = {report['model']:.1f} MiB = "
              f"{report['ratio']:.2f} x file (target <= 1.1); load {os.getloadavg()[0]:.1f}")
        return 0
    for threads in (int(t) for t in args.threads.split(",")):
        for r, figures in enumerate(measure_decode(args.model, threads, args.steps, args.rounds)):
            print(f"{threads} thread(s), round {r}: " + "  ".join(f"{k} {v:6.2f}" for k, v in figures.items())
                  + f"  load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


def measure_decode(model: str, threads: int, steps: int, rounds: int) -> list[dict[str, float]]:
    """Per round: ms per step of process CPU and wall time, and the fused stack's part of each."""
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.engine.factory import build_engine_core
    from tokenmill.model.runner import SeqChunk

    torch.set_num_threads(threads)
    runner = build_engine_core(EngineConfig(model=model, precision="fast", num_threads=threads,
                                            kv_cache_tokens=4096)).runner
    prompt = [100 + 7 * j for j in range(16)]
    pages = list(range(-(-(len(prompt) + steps * rounds + 2) // runner.page_size)))
    runner.execute([SeqChunk(prompt, 0, pages, sample=True)])
    state = {"pos": len(prompt), "token": 500}

    def step() -> None:
        logits = runner.execute([SeqChunk([state["token"]], state["pos"], pages, sample=True)])
        state["pos"] += 1
        state["token"] = int(logits[0].argmax())

    step()  # binds the fused stack
    stack = runner.model._decode_stack
    spent = [0.0, 0.0]
    if stack is not None:
        run = stack.run

        def timed(*a: Any) -> Any:
            c, w = time.process_time(), time.perf_counter()
            out = run(*a)
            spent[0] += time.process_time() - c
            spent[1] += time.perf_counter() - w
            return out

        stack.run = timed
    out = []
    for _ in range(rounds):
        spent[:] = [0.0, 0.0]
        c, w = time.process_time(), time.perf_counter()
        for _ in range(steps):
            step()
        c, w = time.process_time() - c, time.perf_counter() - w
        out.append({"cpu_ms": 1e3 * c / steps, "wall_ms": 1e3 * w / steps, "stack_cpu_ms": 1e3 * spent[0] / steps,
                    "stack_wall_ms": 1e3 * spent[1] / steps, "tok_s": steps / w})
    return out


def measure_memory(model: str) -> dict[str, Any]:
    """RSS stages of LLM(model) in this process (call it in a fresh one: imports count as runtime)."""
    from tokenmill.bench.soak import resident_in

    runtime = _rss()
    from tokenmill import LLM, SamplingParams
    from tokenmill.engine.memory_trim import kv_pool_ranges

    runtime = max(runtime, _rss())
    llm = LLM(model, num_threads=2, precision="fast")
    runner = llm.engine.runner
    stages = {"imports": {"rss": runtime}}

    def stage(name: str) -> dict[str, float]:
        rss = _rss()
        kv_ranges = kv_pool_ranges(runner.kv_caches)
        kv = resident_in(os.getpid(), kv_ranges) / MB
        # everything the model holds except the KV tensors (the fused stack keeps them too)
        held = [r for r in _tensor_ranges(runner.model) if not any(a <= r[0] < b for a, b in kv_ranges)]
        weights = resident_in(os.getpid(), held) / MB
        stages[name] = {"rss": rss, "kv": kv, "weights": weights, "rest": rss - runtime - kv - weights}
        return stages[name]

    stage("LLM()")
    llm.generate(["The quick brown fox"], SamplingParams(max_tokens=32, temperature=0.0))
    last = stage("after generate")
    file_mb = os.path.getsize(model) / MB
    used = last["rss"] - runtime - last["kv"]
    return {"stages": stages, "file": file_mb, "model": used, "ratio": used / file_mb}


def _rss() -> float:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _tensor_ranges(root: Any) -> set[tuple[int, int]]:
    """(start, end) of every tensor storage reachable from `root`'s attributes (the weights)."""
    import torch

    seen: set[int] = set()
    ranges: set[tuple[int, int]] = set()
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen or depth > 8 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.nbytes():
                ranges.add((s.data_ptr(), s.data_ptr() + s.nbytes()))
        elif isinstance(obj, dict):
            stack += [(v, depth + 1) for v in obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            stack += [(v, depth + 1) for v in obj]
        elif hasattr(obj, "__dict__"):
            stack += [(v, depth + 1) for v in vars(obj).values()]
    return ranges
