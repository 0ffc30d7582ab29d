"""The VNNI tiles with the weights in cache, per format and row count (not a test):
`PYTHONPATH=src:. python -m tests.model.bench_tile_rows --types Q6_K Q3_K --shape 576 1536 --rows 8 64 512`.

bench_block_formats streams 30 layers from memory, as a decode step does; this one repeats one
matrix (a layer's ffn_down by default, 576 x 1536: 0.7-1 MB, in L2) so that the figure is the tile's
compute alone, by process CPU time at 1 thread: on a shared machine the least noisy measure of a
change to the tile (docs/benchmarks.md, "GGUF mixes: decode tiles and the six mixes"). Prints CPU
microseconds per row (best of --reps) and the weight bytes per second at the first row count.
"""

from __future__ import annotations

import argparse
import time

import torch

from tests.model.test_block_decoders import random_blocks
from tokenmill.model.kernels import quant_kernel
from tokenmill.model.quant import to_blocked_gguf


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--types", nargs="*", default=["Q5_0", "Q8_0", "Q6_K", "Q3_K", "Q4_K"])
    p.add_argument("--shape", type=int, nargs=2, default=[576, 1536], metavar=("N", "K"))
    p.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64, 512])
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    n, k = args.shape
    for kind in args.types:
        w = to_blocked_gguf(kind, torch.from_numpy(random_blocks(kind, n, k, seed=1, scale=1e-3)), (n, k))
        fn = quant_kernel.bound_blocked_linear(w)
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, k)
            inner = max(1, 2048 // rows)  # ~ the same work per repeat at every row count
            best = float("inf")
            for _ in range(args.reps):
                t = time.process_time()
                for _ in range(inner):
                    fn(x)
                best = min(best, (time.process_time() - t) / inner)
            cells.append(f"{rows} rows {best * 1e6 / rows:7.2f} us/row" +
                         (f" ({w.nbytes / best / 1e9:4.1f} GB/s)" if not cells else ""))
        print(f"{kind:6s} {n}x{k}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
