"""Random GGUF blocks of any type, for tests: any byte pattern is a valid block once its fp16
scales are finite, so random bytes with random scales written over the fp16 fields are one. Values
are linear in those fields, so scaling them sets the weights' spread: `std` keeps a tiny model built
from random blocks numerically tame, like an initialised one."""

from __future__ import annotations

import numpy as np
from gguf.quants import dequantize

from tokenmill.model.quant_formats import format_of, newer_types
from tokenmill.model.quant_formats.registry import gguf_type

# gguf-py can quantize these from float weights (the rest get random blocks).
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4")


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 0.002,
                  std: float | None = None) -> np.ndarray:
    """uint8 [rows, row bytes] of `kind` blocks with finite scales in [scale / 2, scale]; with `std`
    the scales are then multiplied so that the weights' standard deviation is about `std`."""
    fmt = format_of(kind)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    for offset in fmt.fp16_offsets:
        values = rng.uniform(scale / 2, scale, size=len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    if kind == "IQ1_M":  # its fp16 scale is the top nibbles of the four uint16 scale words
        scales = blocks[:, -8:].copy().view(np.uint16)
        d = np.full(len(blocks), scale, dtype=np.float16).view(np.uint16)
        for i in range(4):
            scales[:, i] = (scales[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        blocks[:, -8:] = scales.view(np.uint8)
    if std is not None and fmt.fp16_offsets:
        values = (newer_types.dequantize(kind, blocks) if kind in newer_types.NEWER_TYPES
                  else dequantize(blocks, gguf_type(kind)))
        factor = std / float(values.std())
        for offset in fmt.fp16_offsets:
            field = blocks[:, offset : offset + 2].copy().view(np.float16).astype(np.float32) * factor
            blocks[:, offset : offset + 2] = field.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, fmt.row_bytes(cols))
