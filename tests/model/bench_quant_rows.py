"""Micro benchmark of the VNNI quantized linear kernel by row count (not a test):
`OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000 python -m tests.model.bench_quant_rows`.

Times one layer's projections of the bundled model (qkv, o, gate_up, down, lm_head) at 1..48 rows
(speculative verification and batched decode), then whole-model steps: n rows of one sequence with
600 tokens of context, and 16 single-token rows of 16 sequences. Minimum over repeats: the machine
is shared, the minimum is the least noisy estimate of what the code costs.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill import LLM
from tokenmill.model.runner import SeqChunk

ROWS = (1, 2, 3, 4, 5, 8, 16, 32, 48)
STEP_ROWS = (1, 5, 9)
CONTEXT = 600


def best_us(fn, reps: int, inner: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best * 1e6


def bench_layers(model, rows: tuple[int, ...], reps: int) -> None:
    layer = model.layers[0]
    mods = {"qkv": layer.qkv, "o": layer.o_proj, "gate_up": layer.gate_up, "down": layer.down,
            "lm_head": model.lm_head}
    print("us per call, rows: " + " / ".join(map(str, rows)))
    for name, mod in mods.items():
        n, k = mod.weight.shape
        times = []
        for m in rows:
            x = torch.randn(m, k)
            inner = max(1, 20000 // (n * k // 4096))  # ~ a few ms per repeat
            times.append(best_us(lambda mod=mod, x=x: mod(x), reps, min(inner, 200)))
        print(f"{name:8s} {k}->{n}: " + " / ".join(f"{t:.0f}" for t in times), flush=True)


def bench_steps(llm, reps: int) -> None:
    runner = llm.engine.runner
    pages_per_seq = -(-(CONTEXT + 64) // runner.page_size)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for s in range(16):
        tokens = torch.randint(100, 10000, (CONTEXT,), generator=gen).tolist()
        pages = list(range(s * pages_per_seq, (s + 1) * pages_per_seq))
        runner.execute([SeqChunk(tokens, 0, pages, True)])
        seqs.append(pages)
    with torch.inference_mode():
        for n in STEP_ROWS:
            chunk = [SeqChunk(list(range(200, 200 + n)), CONTEXT, seqs[0], True, num_logits=n)]
            ms = best_us(lambda chunk=chunk: runner.execute(chunk), reps, 3) / 1e3
            print(f"step, {n} rows of one sequence: {ms:.2f} ms", flush=True)
        chunks = [SeqChunk([300 + s], CONTEXT, pages, True) for s, pages in enumerate(seqs)]
        print(f"step, 16 sequences x 1 row: {best_us(lambda: runner.execute(chunks), reps, 3) / 1e3:.2f} ms",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    p.add_argument("--no-steps", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(num_threads=args.threads)
    bench_layers(llm.engine.runner.model, tuple(args.rows), args.reps)
    if not args.no_steps:
        bench_steps(llm, args.reps)


if __name__ == "__main__":
    main()
