"""Microbenchmarks of the KV cache formats: the paged decode-attention kernel alone per cache dtype
(csrc/paged_attention*.h), and what int8 rows lose on a real model's K/V.

`tokenmill bench kv-cache` (or `python -m tokenmill.bench.kv_cache`) times one C++ op on synthetic
caches (SmolLM2's head layout, pages handed out in a shuffled order so that the block table jumps
around the pool, as a long-running server's does), which isolates the kernel from the model, the sampler and the scheduler. Two shapes:
`decode`, many sequences of one row each (the decode step at many streams), and `runs`, sequences of 16
consecutive rows (speculative verification and fast mode's prompt chunks).

    tokenmill bench kv-cache --rows 64 --context 1024 --repeats 20

`--steps` times whole decode steps of the bundled model instead (fast mode, `--rows` streams of
`--context` cached tokens, caches filled with random rows rather than prefilled), per dtype; with
`--shared-prefix N` the rows share their first N tokens' pages (`--prompts K`: K such prefixes, the rows
dealt out in turn, as under K system prompts), timed with cascade attention off and on, alternating.
`--rounding` measures what int8 rows lose on a real model's K/V (the bundled model's cache
after one held-out prompt): the relative RMS error of a scale per token and head (the format used)
against a scale per group of 32 values, per layer range, so the choice of granularity is a number.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench.arg_types import at_least
from tokenmill.model import cpu_attention_kernel as kernel
from tokenmill.model.kv_cache_format import KVCacheFormat, rotate


def make_inputs(fmt: KVCacheFormat, seqs: int, rows: int, context: int, kv_heads: int, group: int, head_dim: int,
                page_size: int, seed: int = 0):
    """q, caches, block table and lengths for `seqs` sequences of `rows` consecutive rows each."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-(context + rows) // page_size)
    num_pages = seqs * pages_per_seq + 8
    order = torch.randperm(num_pages, generator=g)
    caches = []
    for _ in range(2):
        values = torch.randn(kv_heads, num_pages * page_size, head_dim, generator=g)
        caches.append(fmt.encode(values))
    table = order[: seqs * pages_per_seq].view(seqs, pages_per_seq).repeat_interleave(rows, dim=0)
    lens = (torch.arange(rows).repeat(seqs) + context + 1).to(torch.long)
    q = torch.randn(seqs * rows, kv_heads * group, head_dim, generator=g)
    return q, caches[0], caches[1], table.contiguous(), lens


def time_call(args: tuple, page_size: int, scale: float, repeats: int) -> list[float]:
    kernel.paged_decode_attention(*args, page_size, scale)  # warm-up (and first-touch of the pages)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel.paged_decode_attention(*args, page_size, scale)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def group_error(values: torch.Tensor, group: int) -> float:
    """Relative RMS error of symmetric int8 rounding with one scale per `group` values of each row."""
    x = values.float().reshape(-1, group)
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    err = torch.round(x / scale).clamp(-127, 127) * scale - x
    return float(err.pow(2).mean().sqrt() / x.pow(2).mean().sqrt())


def rounding_report(prompt_tokens: int) -> None:
    from tokenmill.bench.quality import held_out_text_path
    from tokenmill.config import EngineConfig
    from tokenmill.engine.factory import build_engine_core
    from tokenmill.frontend.tokenizer import Tokenizer
    from tokenmill.model.default_model import default_model_path
    from tokenmill.model.runner import SeqChunk

    ids = Tokenizer.from_model_path(default_model_path()).encode(Path(held_out_text_path()).read_text())[:prompt_tokens]
    core = build_engine_core(EngineConfig(kv_cache_tokens=prompt_tokens + 16, kv_cache_dtype="fp32"))
    runner = core.runner
    runner.execute([SeqChunk(ids, 0, list(range(runner.num_pages)), sample=True)])
    hd = runner.model.config.head_dim
    print(f"{len(ids)} held-out tokens; relative RMS error of int8 K/V rows (fp32 cache of the bundled model)")
    # "rotated": a scale per row of H x (the shipped format; H orthonormal, so the relative error
    # is the same in either frame)
    print("layers    K per row  K per 32  K rotated  V per row  V per 32  V rotated")
    layers = runner.kv_caches
    for lo in range(0, len(layers), 10):
        k = torch.cat([c[0][:, : len(ids)] for c in layers[lo : lo + 10]])
        v = torch.cat([c[1][:, : len(ids)] for c in layers[lo : lo + 10]])
        print(f"{lo:2d}-{min(lo + 10, len(layers)) - 1:2d}     {group_error(k, hd):8.4f}  {group_error(k, 32):8.4f}  "
              f"{group_error(rotate(k), hd):9.4f}  {group_error(v, hd):8.4f}  {group_error(v, 32):8.4f}  "
              f"{group_error(rotate(v), hd):9.4f}")


def step_report(dtypes: list[str], streams: int, context: int, repeats: int, threads: int, shared: int = 0,
                prompts: int = 1) -> None:
    """Whole decode steps of the bundled model (fast mode) at `streams` rows of `context` cached tokens
    each: the caches are filled with random rows instead of prefilled (only the time matters here).
    With `shared`, the rows' first shared // 16 pages are one of `prompts` prefixes' (row i under
    prefix i % prompts), and the steps are timed with cascade attention (csrc/cascade_attention.h) off
    and at its thresholds, alternating."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.factory import build_engine_core
    from tokenmill.model.cpu_attention_kernel import cascade_thresholds
    from tokenmill.model.kernels import prompt_flash
    from tokenmill.model.runner import SeqChunk

    pages_per_seq = -(-(context + 1) // 16)
    prefix = min(shared // 16, pages_per_seq - 1)
    own = pages_per_seq - prefix
    prompts = prompts if prefix else 1
    under = f" under {prompts} prefixes" if prompts > 1 else ""
    print(f"decode steps, {streams} rows x {context} cached tokens ({prefix * 16} of them shared{under}), bundled "
          f"model, fast, {threads} threads, load {os.getloadavg()[0]:.2f}; ms per step, median [min-max] of {repeats}")
    for name in dtypes:
        core = build_engine_core(EngineConfig(kv_cache_tokens=(prompts * prefix + streams * own) * 16,
                                              kv_cache_dtype=name, num_threads=threads))
        runner = core.runner
        fmt = runner.kv_format
        g = torch.Generator().manual_seed(0)
        for k, v in runner.kv_caches:
            for cache in (k, v):
                values = torch.randn(cache.shape[0], cache.shape[1], runner.model.config.head_dim, generator=g)
                cache.copy_(fmt.encode(values))
        runner._zeroed_pages = runner.num_pages  # filled above: nothing left to zero
        base = prompts * prefix  # the prefixes' pages, then each row's own
        chunks = [SeqChunk([100 + i], context, list(range(i % prompts * prefix, (i % prompts + 1) * prefix))
                           + list(range(base + i * own, base + (i + 1) * own)), sample=True) for i in range(streams)]
        runner.execute(chunks)
        stack = runner.model._decode_stack  # None: steps op by op; no tiles: nothing to cascade on
        kinds = {"": None} if not prefix or stack is None or not prompt_flash.available() else {
            " cascade off": (0, 0), " cascade on": cascade_thresholds(runner.kv_caches[0][0].dtype, fused_step=True)}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(repeats):
            for kind, thresholds in kinds.items():
                if thresholds is not None:
                    stack.set_cascade(*thresholds)
                start = time.perf_counter()
                runner.execute(chunks)
                times[kind].append((time.perf_counter() - start) * 1e3)
        for kind, t in times.items():
            print(f"{name:5s}{kind} {statistics.median(t):8.1f} [{min(t):.1f}-{max(t):.1f}]  "
                  f"({runner.kv_bytes_per_token} KV bytes a token)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtypes", default="fp32,bf16,int8", help="comma-separated cache dtypes")
    p.add_argument("--rows", type=at_least(1), default=64, help="sequences of the decode shape")
    p.add_argument("--context", type=at_least(1), default=1024, help="cached tokens of each sequence")
    p.add_argument("--run-seqs", type=at_least(1), default=4, help="sequences of 16 rows in the runs shape")
    p.add_argument("--repeats", type=at_least(1), default=20)
    p.add_argument("--num-threads", type=at_least(1), default=2)
    p.add_argument("--rounding", action="store_true", help="int8 rounding error on the bundled model's K/V instead")
    p.add_argument("--steps", action="store_true", help="whole decode steps of the bundled model at --rows streams")
    p.add_argument("--shared-prefix", type=at_least(0), default=0,
                   help="with --steps: tokens of the context all rows share (whole pages), timed with cascade off and on")
    p.add_argument("--prompts", type=at_least(1), default=1,
                   help="with --shared-prefix: that many distinct prefixes, the rows dealt out over them")


def add_kv_cache_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("kv-cache", help="the paged decode-attention kernel per KV cache dtype (fp32, bf16, int8)")
    add_arguments(p)
    p.set_defaults(func=cmd_kv_cache)


def cmd_kv_cache(a: argparse.Namespace) -> int:
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    try:
        formats = [KVCacheFormat.named(d) for d in dtypes]
    except ValueError as exc:
        print(f"error: --dtypes: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(a.num_threads)
    if a.rounding:
        rounding_report(512)
        return 0
    if a.steps:
        step_report(dtypes, a.rows, a.context, a.repeats, a.num_threads, a.shared_prefix, a.prompts)
        return 0
    if not kernel.available():
        print("error: the CPU attention kernel is not available", file=sys.stderr)
        return 1
    kv_heads, group, hd, page_size = 3, 3, 64, 16  # SmolLM2-135M's attention
    print(f"threads {a.num_threads}, load {os.getloadavg()[0]:.2f}, context {a.context}, head_dim {hd}, "
          f"{kv_heads} KV heads x group {group}, page {page_size}; ms per call, median [min-max] of {a.repeats}")
    for fmt in formats:
        for shape, seqs, rows in (("decode", a.rows, 1), ("runs", a.run_seqs, 16)):
            inputs = make_inputs(fmt, seqs, rows, a.context, kv_heads, group, hd, page_size)
            t = time_call(inputs, page_size, hd**-0.5, a.repeats)
            print(f"{fmt.name:5s} {shape:6s} {seqs:3d} x {rows:2d} rows: {statistics.median(t):8.3f} "
                  f"[{min(t):.3f}-{max(t):.3f}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return cmd_kv_cache(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
