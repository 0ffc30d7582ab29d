"""Micro benchmark of the VNNI kernels per GGUF block format (not a test):
`OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000 python -m tests.model.bench_block_formats`.

30 layers of SmolLM2-135M's shapes with the inputs rounded up to a multiple of 256 (so that every
format, super-blocks included, has the same matrices: q/k/v 768->960, o 768->768, gate/up 768->3072,
down 1536->768), random blocks of one type, each linear called in turn so that the weights stream
from memory as in a real step (performance.md). Prints ms per 30-layer pass at 1 and 16 rows and the
weight bytes per second of the 1-row pass (`--dequant`: also the
bf16 dequantization a prompt step runs before oneDNN); minimum over repeats (a shared machine: the least noisy).
`--cpu-time` times by process CPU time instead of the wall clock: on a machine shared by more
processes than cores, a process waits for a core most of the time, and CPU time (with --threads 1)
is what the kernel itself costs (still slowed by the others' use of caches and memory).
"""

from __future__ import annotations

import argparse
import time

import torch

from tests.model.test_block_decoders import random_blocks
from tokenmill.model.kernels import quant_kernel
from tokenmill.model.quant import to_blocked_gguf

SHAPES = ((960, 768), (768, 768), (3072, 768), (768, 1536))
TYPES = ("Q4_1", "Q4_0", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS")


def bench(kind: str, layers: int, rows: tuple[int, ...], reps: int, clock=time.perf_counter,
          dequant: bool = False) -> str:
    calls, weights, nbytes = [], [], 0
    for i in range(layers):
        for j, (n, k) in enumerate(SHAPES):
            w = to_blocked_gguf(kind, torch.from_numpy(random_blocks(kind, n, k, seed=4 * i + j, scale=1e-3)), (n, k))
            nbytes += w.nbytes
            weights.append(w)
            calls.append((quant_kernel.bound_blocked_linear(w), k))
    out = [f"{kind:7s} {nbytes / 1e6:6.1f} MB"]
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {k for _, k in SHAPES}}
        best = float("inf")
        for _ in range(reps):
            t = clock()
            for fn, k in calls:
                fn(xs[k])
            best = min(best, clock() - t)
        out.append(f"{m:2d} rows {best * 1e3:6.2f} ms" + (f" ({nbytes / best / 1e9:4.1f} GB/s)" if m == 1 else ""))
    if dequant:  # what a prompt step pays before oneDNN's bf16 GEMM: every weight to a bf16 matrix
        best = float("inf")
        for _ in range(reps):
            t = clock()
            for w in weights:
                quant_kernel.blocked_dequantize_bf16(w)
            best = min(best, clock() - t)
        out.append(f"to bf16 {best * 1e3:6.2f} ms")
    return "  ".join(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--types", nargs="*", default=list(TYPES))
    p.add_argument("--rows", type=int, nargs="*", default=[1, 16])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu-time", action="store_true")
    p.add_argument("--dequant", action="store_true", help="also time dequantizing every weight to bf16 (prompt steps)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    for kind in args.types:
        print(bench(kind, args.layers, tuple(args.rows), args.reps, clock, args.dequant), flush=True)


if __name__ == "__main__":
    main()
