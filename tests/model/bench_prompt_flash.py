"""Our prompt attention on AMX tiles against torch's flash attention per shape (not a test), in one
process: `PYTHONPATH=src:. python -m tests.model.bench_prompt_flash [--threads 2]` prints, per shape, the
median ms of each as model/prompt_attention.py calls them (torch: one causal call for a fresh chunk,
the prefix and the chunk in two calls merged for a long chunk after a prefix) and torch's time over
ours (docs/benchmarks.md, "Our own prompt attention on the tiles"). Inputs are random bf16.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F

from tests.model.bench_amx_tiles import median_ms
from tokenmill.model import prompt_attention
from tokenmill.model.kernels import prompt_flash

# (what, queries, keys, heads, KV heads, head_dim)
SHAPES = [("SmolLM2, 512 fresh", 512, 512, 9, 3, 64), ("SmolLM2, 2,048 fresh", 2048, 2048, 9, 3, 64),
          ("SmolLM2, 1,000 after 1,000", 1000, 2000, 9, 3, 64), ("SmolLM2, 256 after 4,000", 256, 4256, 9, 3, 64),
          ("Gemma 3 heads, 512 fresh", 512, 512, 4, 1, 256), ("8B heads, 512 fresh", 512, 512, 32, 8, 128)]


def torch_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    query, keys, values = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    offset = k.shape[1] - q.shape[0]
    if offset == 0:
        return F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
    return prompt_attention._causal_after_prefix(query, keys, values, offset, None, True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not prompt_flash.available():
        raise SystemExit("no AMX tiles here for the prompt attention kernel (or TOKENMILL_CPU_ISA caps them)")
    torch.set_num_threads(args.threads)
    print(f"{'shape':28s} {'torch ms':>9s} {'tiles ms':>9s} {'torch / tiles':>14s}")
    for what, q_len, kv_len, heads, kvh, hd in SHAPES:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(q_len, heads, hd, generator=g).bfloat16()
        k, v = (torch.randn(kvh, kv_len, hd, generator=g).bfloat16() for _ in range(2))
        theirs = median_ms(partial(torch_flash, q, k, v), reps=15)
        ours = median_ms(partial(prompt_flash.attend_rows, q, k, v, hd**-0.5, True), reps=15)
        print(f"{what:28s} {theirs:9.2f} {ours:9.2f} {theirs / ours:13.2f}x", flush=True)


if __name__ == "__main__":
    main()
