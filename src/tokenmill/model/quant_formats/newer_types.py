"""GGML tensor types newer than the `gguf` package: their ids, blocks and exact values.

llama.cpp adds types before gguf-py's release on PyPI can read them: gguf 0.19.0 names Q1_0 (the
1-bit type 1-bit models ship in) but cannot dequantize it, and does not know Q2_0 at all, so its
reader refuses the whole file. Each type here is ggml's own definition (ggml-common.h's block
struct, ggml-quants.c's `dequantize_row_*`: the values are bit for bit the ones llama.cpp computes,
checked against libggml in docs/benchmarks.md); `registry.py` takes a block size from here only
where the installed package lacks the name, and the exact path dequantizes these types here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NewerType:
    name: str
    type_id: int  # ggml_type
    block_elems: int
    block_bytes: int


# ggml.h `ggml_type`; each block is an fp16 d, then the codes, low bits first.
NEWER_TYPES: dict[str, NewerType] = {
    "Q1_0": NewerType("Q1_0", 41, 128, 2 + 128 // 8),  # 1 bit a weight: +d or -d
    "Q2_0": NewerType("Q2_0", 42, 64, 2 + 64 // 4),  # 2 bits a weight: (q - 1) d, q = 0..3
}


def codes(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks uint8 [..., block bytes] -> (d as float16 [...], codes uint8 [..., block elems]): Q1_0's
    bit j of the block (byte j // 8, bit j % 8), Q2_0's crumb j (byte j // 4, bits 2 (j % 4))."""
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    qs = blocks[..., 2:]
    if kind == "Q1_0":
        return d, np.unpackbits(qs, axis=-1, bitorder="little")
    if kind == "Q2_0":
        crumbs = (qs[..., :, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
        return d, crumbs.reshape(*qs.shape[:-1], -1)
    raise ValueError(f"{kind} is not one of the newer GGML types ({', '.join(NEWER_TYPES)})")


def dequantize(kind: str, raw: np.ndarray) -> np.ndarray:
    """float32 values of whole blocks (uint8, any shape whose last axis is a whole number of blocks),
    flattened per row as the blocks lie: ggml's arithmetic, d * (q - 1) or (bit ? d : -d) in fp32."""
    t = NEWER_TYPES[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, t.block_bytes)
    d, q = codes(kind, blocks)
    d32 = d.astype(np.float32)[:, None]
    if kind == "Q1_0":
        values = np.where(q == 1, d32, -d32)
    else:
        values = d32 * (q.astype(np.float32) - 1.0)
    return values.astype(np.float32).reshape(*raw.shape[:-1], -1)
