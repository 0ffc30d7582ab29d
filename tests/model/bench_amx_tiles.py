"""The AMX-BF16 tiles against the VNNI kernel's two int8 terms per weight shape and row count (not a
test), in one process: `PYTHONPATH=src:. python -m tests.model.bench_amx_tiles [--rows 16 48 64 512]
[--threads 2]` prints, per shape, the median ms of each and VNNI's time over AMX's (docs/benchmarks.md,
"AMX-BF16 tiles for the kernel's prompts"). Weights are random blocks of SmolLM2's and the MoE's shapes.
"""

from __future__ import annotations

import argparse
import time

import torch

from tests.model.test_block_decoders import weight
from tokenmill.model.kernels import quant_kernel

SHAPES = [("Q4_1", 3072, 576), ("Q5_0", 3072, 576), ("Q5_0", 576, 1536), ("Q6_K", 576, 1536), ("Q8_0", 3072, 576),
          ("Q4_K", 3072, 1024), ("Q4_K", 1024, 512), ("Q6_K", 1024, 512), ("Q3_K", 3072, 1024), ("Q3_K", 1024, 3072)]


def median_ms(fn, reps: int = 21) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 48, 64, 128, 512])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not quant_kernel.amx_available():
        raise SystemExit("no AMX-BF16 here (or TOKENMILL_CPU_ISA caps it)")
    torch.set_num_threads(args.threads)
    for kind, n, k in SHAPES:
        w, _, _ = weight(kind, n, k)
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, k)
            vnni = median_ms(lambda x=x, w=w: quant_kernel.blocked_linear(x, w, amx=False))
            amx = median_ms(lambda x=x, w=w: quant_kernel.blocked_linear_amx(x, w))
            cells.append(f"{rows}: {vnni:.3f} / {amx:.3f} = {vnni / amx:.2f}x")
        print(f"{kind} {n} x {k} (VNNI / AMX ms)  " + "   ".join(cells))


if __name__ == "__main__":
    main()
