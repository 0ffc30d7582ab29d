"""Exact dequantization of every GGUF type: gguf-py's own arithmetic, a slab of rows at a time.

The exact path must see the numbers transformers sees when it reads the same file, and transformers
dequantizes with `gguf.quants.dequantize`; calling it is the only way to be bit-identical by
construction for all ~25 types (and their future fixes). The types gguf-py cannot dequantize yet
take ggml's own arithmetic (newer_types.py). Each block dequantizes independently of
the others, so slicing the rows changes nothing, and it bounds gguf-py's float32 temporaries
(several times the slab) while the result goes straight into the tensor the caller keeps, in fp32
or rounded once to bf16.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize

from tokenmill.model.quant_formats import newer_types
from tokenmill.model.quant_formats.registry import format_of, gguf_type

# Rows per slab: at most ~4M weights of float32 temporaries at a time.
_SLAB_WEIGHTS = 1 << 22


def dequantize_rows(kind: str, raw: np.ndarray, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, k] values of the rows `raw` (uint8 [N, row bytes] as the file holds them)."""
    fmt = format_of(kind)
    n = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] != fmt.row_bytes(k):
        raise ValueError(f"{kind} rows of {k} weights take {fmt.row_bytes(k)} bytes, got {tuple(raw.shape)}")
    out = torch.empty(n, k, dtype=dtype)
    step = max(1, _SLAB_WEIGHTS // max(k, 1))
    qtype = gguf_type(kind)
    for start in range(0, n, step):
        slab = np.ascontiguousarray(raw[start : start + step])
        # F32 / F16 / BF16 too: the same call transformers makes
        values = newer_types.dequantize(kind, slab) if kind in newer_types.NEWER_TYPES else gguf_dequantize(slab, qtype)
        out[start : start + step] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1, k))
    return out

