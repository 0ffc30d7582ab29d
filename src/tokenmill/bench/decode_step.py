"""`tokenmill bench decode-step`: the fused decode step alone (csrc/decode_step.cpp), and its barriers.

Why: the step is the whole layer stack of a batch-1 decode in one C++ call; a change to it (issue 21's
shared phases, a different barrier) must not move its speed, and on a shared machine wall time is
noise. So the command times the bare C++ call, captured from a real decode step of MODEL (one row at
`--context` tokens, fast mode), three ways:
  - process CPU time a step at 1 thread (what load barely moves: the arithmetic's cost);
  - wall time and CPU time a step at `--num-threads`, for each `--barriers` kind in turn, blocks
    alternating between the kinds so that load drifts hit all of them alike;
  - with `--barrier-stats`: barriers a step, and the share of the threads' time spent waiting in them,
    of which the part after the last thread had arrived (the barrier's own cost, step_barrier.h).
Figures are the best and the median of `--blocks` blocks of `--steps` calls. It also runs as a plain
script (`python .../decode_step.py --model ...`) against another tree's `tokenmill` on PYTHONPATH, for
before/after comparisons with a tree that lacks the command (such a tree offers only "omp").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from tokenmill.bench.arg_types import at_least

BARRIER_KINDS = {"omp": 0, "spin": 1}


def add_decode_step_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("decode-step", help="the fused decode step's C++ call alone: CPU and wall time, barriers")
    add_arguments(p)
    p.set_defaults(func=cmd_decode_step)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a GGUF file (or folder) whose decode steps run the fused call")
    p.add_argument("--context", type=int, default=300, help="tokens in the KV cache before the timed step")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--steps", type=at_least(1), default=50, help="calls a block")
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--barriers", default="omp",
                   help="comma-separated kinds to alternate: omp, spin, or spin:US (a spin budget of its own)")
    p.add_argument("--spin-us", type=int, default=50, help="the spin barrier's budget before it sleeps")
    p.add_argument("--barrier-stats", action="store_true", help="time every barrier (one extra block per kind)")
    p.add_argument("--json", metavar="PATH", default=None)


class _Recorder:
    """Stands in for the C++ stack for one step and keeps the arguments of its `run`."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.args = stack, None

    def run(self, *args: Any) -> Any:
        self.args = args
        return self.stack.run(*args)


def capture_step(model_path: str, context: int, threads: int) -> tuple[Any, tuple]:
    """The model's C++ decode stack and the arguments of one decode row's call at `context` tokens."""
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.engine.factory import build_engine_core
    from tokenmill.model.runner import SeqChunk

    config = EngineConfig(model=model_path, precision="fast", num_threads=threads, hybrid_kv_cache=False,
                          kv_cache_tokens=max(4096, context + 256))
    runner = build_engine_core(config).runner
    model = runner.model
    if not getattr(model, "fused_decode", False):
        raise SystemExit(f"{model_path}: its decode steps do not run the fused call (fast mode, AVX512-VNNI)")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = [int(t) for t in torch.randint(min(1000, vocab // 2), min(20000, vocab), (context,), generator=g)]
    pages = list(range(-(-(context + 8) // runner.page_size)))
    runner.execute([SeqChunk(prompt, 0, pages, sample=True)])
    runner.execute([SeqChunk(prompt[-1:], context, pages, sample=True)])  # binds the stack
    return captured_call(model, lambda: runner.execute([SeqChunk(prompt[-1:], context + 1, pages, sample=True)]))


def captured_call(model: Any, step: Callable[[], Any]) -> tuple[Any, tuple]:
    """The C++ stack bound to `model` (by an earlier fused step) and the arguments `step`, a runner
    step of decode rows, calls its `run` with."""
    holder = model._decode_stack
    recorder = holder._stack = _Recorder(holder._stack)
    try:
        step()
    finally:
        holder._stack = recorder.stack
    return recorder.stack, recorder.args


def time_blocks(call: Any, steps: int) -> tuple[float, float]:
    """(wall, CPU) ms a call over one block of `steps` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        call()
    return (time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3


def summary(values: list[float]) -> dict[str, float]:
    return {"best": round(min(values), 4), "median": round(statistics.median(values), 4)}


def _has_method(stack: Any, name: str) -> bool:
    try:
        getattr(stack, name)
    except (AttributeError, RuntimeError):  # what a TorchScript object raises varies
        return False
    return True


def set_barrier(stack: Any, kind: str, spin_us: int, log: bool) -> None:
    """`kind`: omp, spin (with `spin_us`) or spin:US."""
    name, _, budget = kind.partition(":")
    if _has_method(stack, "set_barrier"):
        stack.set_barrier(BARRIER_KINDS[name], int(budget) if budget else spin_us, log)
    elif kind != "omp" or log:
        raise SystemExit(f"this tree's decode step has only `omp` barriers and no barrier stats (asked: {kind})")


def barrier_kinds(text: str) -> list[str]:
    """The kinds of `--barriers`; ValueError naming the bad ones."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k.partition(":")[0] not in BARRIER_KINDS
               or (k.partition(":")[2] and not k.partition(":")[2].isdigit())]
    if not kinds or unknown:
        raise ValueError(f"--barriers: unknown kind(s) {unknown}; choose from omp, spin, spin:US")
    return kinds


def measure(args: argparse.Namespace) -> dict:
    import torch

    kinds = barrier_kinds(args.barriers)
    stack, call_args = capture_step(args.model, args.context, args.num_threads)
    x0, rest = call_args[0].clone(), call_args[1:]
    x = x0.clone()

    def call() -> None:
        x.copy_(x0)  # the step updates its residual stream in place
        stack.run(x, *rest)

    result: dict[str, Any] = {"load_start": round(os.getloadavg()[0], 2)}
    torch.set_num_threads(1)
    set_barrier(stack, "omp", args.spin_us, False)
    call()
    cpu1 = [time_blocks(call, args.steps)[1] for _ in range(args.blocks)]
    result["cpu_ms_1_thread"] = summary(cpu1)
    torch.set_num_threads(args.num_threads)
    walls: dict[str, list[float]] = {k: [] for k in kinds}
    cpus: dict[str, list[float]] = {k: [] for k in kinds}
    for kind in kinds:
        set_barrier(stack, kind, args.spin_us, False)
        call()
    for _ in range(args.blocks):
        for kind in kinds:
            set_barrier(stack, kind, args.spin_us, False)
            wall, cpu = time_blocks(call, args.steps)
            walls[kind].append(wall)
            cpus[kind].append(cpu)
    result["threads"] = {k: {"wall_ms": summary(walls[k]), "cpu_ms": summary(cpus[k])} for k in kinds}
    if args.barrier_stats:
        for kind in kinds:
            set_barrier(stack, kind, args.spin_us, True)
            time_blocks(call, args.steps)
            steps, barriers, step_ns, wait_ns, late_ns = stack.barrier_stats()
            thread_ns = step_ns * args.num_threads
            result["threads"][kind]["barriers"] = {
                "per_step": barriers / steps, "step_ms": round(step_ns / steps / 1e6, 4),
                "wait_share": round(wait_ns / thread_ns, 4), "after_last_arrival_share": round(late_ns / thread_ns, 4),
                "after_last_arrival_us": round(late_ns / barriers / args.num_threads / 1e3, 3)}
        set_barrier(stack, kinds[0], args.spin_us, False)
    result["load_end"] = round(os.getloadavg()[0], 2)
    return result


def cmd_decode_step(args: argparse.Namespace) -> int:
    try:
        barrier_kinds(args.barriers)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    result = measure(args)
    print(f"fused decode step of {os.path.basename(args.model)}, one row at {args.context} tokens of context "
          f"(best / median of {args.blocks} blocks of {args.steps}; load {result['load_start']} -> {result['load_end']})")
    c = result["cpu_ms_1_thread"]
    print(f"  1 thread: CPU {c['best']:.3f} / {c['median']:.3f} ms a step")
    for kind, r in result["threads"].items():
        w, c = r["wall_ms"], r["cpu_ms"]
        line = (f"  {args.num_threads} threads, {kind:4s} barriers: wall {w['best']:.3f} / {w['median']:.3f} ms, "
                f"CPU {c['best']:.3f} / {c['median']:.3f} ms a step")
        b = r.get("barriers")
        if b:
            line += (f"; {b['per_step']:.0f} barriers a step, {100 * b['wait_share']:.1f}% of thread time waiting, "
                     f"{100 * b['after_last_arrival_share']:.1f}% after the last arrival "
                     f"({b['after_last_arrival_us']:.2f} us a barrier and thread)")
        print(line)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"settings": vars(args) | {"func": None}, "result": result}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(cmd_decode_step(parser.parse_args()))
