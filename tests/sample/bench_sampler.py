"""Micro benchmark of one sampler step (not a test): `python -m tests.sample.bench_sampler`."""

from __future__ import annotations

import statistics
import time

import torch

from tokenmill.sample.sampler import Sampler
from tokenmill.sample.sampling_batch import SamplingBatch
from tokenmill.sample.sampling_params import SamplingParams

MODES = {
    # Every processor and filter at once; half the rows seeded, half still under min_tokens.
    "all": dict(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={11: 2.0, 12: -3.0},
        bad_words_token_ids=[13, 14],
        min_tokens=300,
    ),
    "all+logprobs": dict(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={11: 2.0, 12: -3.0},
        bad_words_token_ids=[13, 14],
        min_tokens=300,
        logprobs=5,
    ),
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),  # unfiltered: noise over the whole vocabulary
    "top_p": dict(temperature=0.8, top_p=0.95),
}


def fake_logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """LLM-like rows: a flat noisy tail plus a peaked head of ~100 likely tokens."""
    logits = torch.randn(rows, vocab, generator=gen) * 2.0
    head = torch.randint(0, vocab, (rows, 100), generator=gen)
    logits.scatter_add_(1, head, torch.linspace(14.0, 4.0, 100).expand(rows, -1).contiguous())
    return logits


def bench_sampler(
    rows: int = 64,
    vocab: int = 49152,
    iters: int = 30,
    mode: str = "all",
    threads: int | None = 2,
    prompt_len: int = 512,
    output_len: int = 256,
) -> float:
    """Median ms per sampler call over `iters` steps, after a warm-up step."""
    if threads is not None:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    kw = MODES[mode]
    seeded = mode.startswith("all")
    params = [
        SamplingParams(
            seed=i if seeded and i % 2 else None,
            max_tokens=None,
            **{**kw, "min_tokens": kw.get("min_tokens", 0) * (i // 2 % 2)},
        )
        for i in range(rows)
    ]
    gens = [torch.Generator().manual_seed(i) if p.seed is not None else None for i, p in enumerate(params)]
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (output_len,), generator=gen).tolist() for _ in range(rows)]
    logits = [fake_logits(rows, vocab, gen) for _ in range(4)]
    sampler = Sampler(vocab, eos_token_ids=[2], seed=0)
    times = []
    for step in range(iters + 1):
        batch = SamplingBatch(params, gens, prompts, outputs)
        start = time.perf_counter()
        tokens = sampler(logits[step % 4], batch).token_ids.tolist()
        times.append((time.perf_counter() - start) * 1e3)
        for out, tok in zip(outputs, tokens):
            out.append(tok)  # like the engine: the same lists grow by one token a step
    return statistics.median(times[1:])


if __name__ == "__main__":
    for name in MODES:
        print(f"{name:>14}: {bench_sampler(mode=name):7.2f} ms/step (64 x 49152, 2 threads)")
