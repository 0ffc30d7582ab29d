"""Micro benchmarks of the gemma fast path (not tests), best of repeated blocks (the machine is shared):

`python -m tests.model.bench_gemma_step kernel` times the paged decode-attention kernel on SmolLM2's
shape (9 heads, 3 KV heads, head_dim 64, bf16 cache, pages in random order) without a window or cap,
one thread: run it from two trees (PYTHONPATH) to see what the window support costs llama.

`OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000 python -m tests.model.bench_gemma_step step` times a
runner step of one decode row of the real Gemma 3 270M (fast, 2 threads, ~300 tokens of context)
and its tied lm_head alone.

`python -m tests.model.bench_gemma_step prompt-attention` times the kernel on a 512-token prompt sent
as decode rows (Gemma 3's shape: 4 heads, 1 KV head, head_dim 256, bf16 cache; windows 512 and none),
process CPU time at one thread: run it from two trees to compare.

`python -m tests.model.bench_gemma_step prompt` times a runner step of a 512-token prompt of the real
Gemma 3 270M (fast, prompt as decode rows as the engine sends it) in process CPU time at one thread,
and lists the ops that take it (torch.profiler).
"""

from __future__ import annotations

import sys
import time

import torch


def best_ms(fn, inner: int = 10, blocks: int = 5, clock=time.perf_counter) -> float:
    """Best of `blocks` per call; clock=time.process_time: process CPU time, which load on the other
    cores barely moves."""
    times = []
    for _ in range(blocks):
        t = clock()
        for _ in range(inner):
            fn()
        times.append((clock() - t) / inner * 1e3)
    return min(times)


def kernel() -> None:
    from tokenmill.model import cpu_attention_kernel as k

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for rows, ctx in ((16, 1000), (1, 4000)):
        pages = rows * -(-ctx // 16)
        kc, vc = (torch.randn(3, (pages + 4) * 16, 64, generator=g).bfloat16() for _ in range(2))
        table = torch.randperm(pages + 4, generator=g)[:pages].view(rows, -1)
        lens, q = torch.tensor([ctx - i for i in range(rows)]), torch.randn(rows, 9, 64, generator=g)
        args = (q, kc, vc, table, lens, 16, 0.125)
        ms = best_ms(lambda args=args: k.paged_decode_attention(*args), inner=20, blocks=7)
        print(f"{rows} rows x ~{ctx} tokens: {ms * 1e3:.1f} us/call")


def step() -> None:
    from tests.gemma_model import gemma_runner
    from tokenmill.model.runner import SeqChunk

    torch.set_num_threads(2)
    runner = gemma_runner("fast", num_pages=64)
    model = runner.model
    prompt = [2, *range(1000, 1300)]
    runner.execute([SeqChunk(prompt, 0, list(range(64)), sample=True)])
    pos = len(prompt)

    def one() -> None:
        nonlocal pos
        runner.execute([SeqChunk([1234], pos, list(range(64)), sample=True)])
        pos += 1

    print(f"fused decode step: {model.fused_decode}; lm_head: {model.lm_head.describe()}")
    print(f"step {best_ms(one):.1f} ms, lm_head {best_ms(lambda: model.compute_logits(torch.randn(1, 640))):.1f} ms")


def prompt_attention() -> None:
    from tokenmill.model import cpu_attention_kernel as k

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n, pages = 512, 32 + 4
    kc, vc = (torch.randn(1, pages * 16, 256, generator=g).bfloat16() for _ in range(2))
    table = torch.randperm(pages, generator=g)[:32].repeat(n, 1)
    lens, q = torch.arange(1, n + 1), torch.randn(n, 4, 256, generator=g)
    for window in (512, None):
        args = (q, kc, vc, table, lens, 16, 0.0625)
        ms = best_ms(lambda args=args, window=window: k.paged_decode_attention(*args, window=window), 5, 3,
                     time.process_time)
        print(f"{n}-token prompt as rows, window {window}: {ms:.2f} ms CPU/call (one layer)")


def prompt() -> None:
    from tests.gemma_model import gemma_weights
    from tokenmill.model.layers.factory import LayerPolicy
    from tokenmill.model.registry import model_class
    from tokenmill.model.runner import ModelRunner, SeqChunk

    torch.set_num_threads(1)
    loaded = gemma_weights()
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, 4096, policy=LayerPolicy("fast"))
    runner = ModelRunner(model, 40, 16, torch.bfloat16, prefill_as_decode_rows=True)
    chunk = SeqChunk([2, *range(1000, 1511)], 0, list(range(32)), sample=True)
    runner.execute([chunk])
    print(f"512-token prompt step: {best_ms(lambda: runner.execute([chunk]), 3, 3, time.process_time):.1f} ms CPU at one thread")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.execute([chunk])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    modes = {"kernel": kernel, "step": step, "prompt-attention": prompt_attention, "prompt": prompt}
    modes[sys.argv[1] if len(sys.argv) > 1 else "step"]()
