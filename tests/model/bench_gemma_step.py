"""Micro benchmarks of the gemma fast path (not tests), best of repeated blocks (the machine is shared):

`python -m tests.model.bench_gemma_step kernel` times the paged decode-attention kernel on SmolLM2's
shape (9 heads, 3 KV heads, head_dim 64, bf16 cache, pages in random order) without a window or cap,
one thread: run it from two trees (PYTHONPATH) to see what the window support costs llama.

`OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000 python -m tests.model.bench_gemma_step step` times a
runner step of one decode row of the real Gemma 3 270M (fast, 2 threads, ~300 tokens of context)
and its tied lm_head alone.
"""

from __future__ import annotations

import sys
import time

import torch


def best_ms(fn, inner: int = 10, blocks: int = 5) -> float:
    times = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner * 1e3)
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


if __name__ == "__main__":
    {"kernel": kernel, "step": step}[sys.argv[1] if len(sys.argv) > 1 else "step"]()
