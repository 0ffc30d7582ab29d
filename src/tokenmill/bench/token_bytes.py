"""What a batch-1 decode token must read, and how fast this machine reads that much.

A prompt is bound by multiply-adds, so `bench latency` puts its tok/s against the matmul ceilings.
One decode token is bound by bytes: every weight it uses is read once from memory, and no engine can
make a token faster than those bytes take at the machine's read rate. This module gives both numbers,
so the decode rows say what share of that bound each engine reaches (and what a ratio against a peer
would ask for: twice llama.cpp's tokens/s at 46 % of the bound needs 92 %).

The bytes are the file's own (both engines read the same quantized blocks): every tensor once, but
the token embedding as one row unless it is also the lm_head (no `output.weight`), and each layer's
merged expert tensors (`*_exps`) at the token's share, `expert_used_count / expert_count`. The
attention's KV reads are left out (a few hundred kB at short contexts).

The read rate is the best of repeated sums over a buffer of that size on the run's threads: a size
matters, since a buffer that fits the last-level cache reads faster than one that does not.
"""

from __future__ import annotations

import torch

from tokenmill.bench.common import best_seconds
from tokenmill.model.gguf_file import read_gguf


def token_weight_bytes(path: str) -> int | None:
    """Bytes of `path`'s weights one batch-1 decode token reads; None for a model that is not a GGUF file."""
    if not path.endswith(".gguf"):
        return None
    gguf = read_gguf(path)
    arch = gguf.metadata.get("general.architecture", "")
    experts = gguf.metadata.get(f"{arch}.expert_count") or 0
    used = gguf.metadata.get(f"{arch}.expert_used_count") or 0
    tied = not any(t.name == "output.weight" for t in gguf.tensors)
    total = 0
    for t in gguf.tensors:
        size = t.data.nbytes
        if t.name == "token_embd.weight" and not tied:
            total += size // t.shape[0]  # the token's row
        elif "_exps." in t.name and experts:
            total += size * used // experts
        else:
            total += size
    return total


def read_ceiling(threads: int, nbytes: int, seconds: float = 0.5) -> float:
    """Best GB/s of a float32 sum over `nbytes` (rounded down to whole floats) at `threads` threads.

    Best-of, as the matmul ceilings: other processes only ever make a sample slower."""
    torch.set_num_threads(threads)
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)  # written once: resident, not zero pages
    x.sum()
    return x.numel() * 4 / best_seconds(x.sum, seconds) / 1e9
