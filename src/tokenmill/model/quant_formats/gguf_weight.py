"""A GGUF matrix as the file holds it: whole rows of blocks, not yet turned into any kernel's layout.

The loader hands these to the layer factory, which decides per precision what each becomes (the
kernels' re-layout of the same bits, bf16 for a type without a kernel, gguf-py's fp32 for exact);
nothing is dequantized before that, so loading never holds an fp32 copy of the model. Row
operations (llama's q/k un-permutation, fused q/k/v, a column-parallel shard) move whole rows of
bytes and are lossless; a row-parallel shard cuts rows between blocks, never inside one.

`raw` is often a view of the memory-mapped file: once a weight has been converted, `release()`
drops the pages it read from this process (they stay in the page cache, not in its RSS), so that
loading peaks near the file's size instead of twice it.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.model.quant_formats.dequantize import dequantize_rows
from tokenmill.model.quant_formats.registry import QuantFormat, format_of

_MADV_DONTNEED = 4  # Linux; file-backed clean pages are simply read again on the next access
_libc = None


@dataclass
class GGUFWeight:
    kind: str  # GGUF type name
    raw: np.ndarray  # uint8 [N, row bytes]
    shape: tuple[int, int]  # (N, K) in weights

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.raw.shape != (n, self.format.row_bytes(k)):
            raise ValueError(f"{self.kind} [{n}, {k}] needs {n} rows of {self.format.row_bytes(k)} bytes, "
                             f"got {tuple(self.raw.shape)}")

    @property
    def format(self) -> QuantFormat:
        return format_of(self.kind)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] with gguf-py's values (fp32), or those rounded once to `dtype`."""
        return dequantize_rows(self.kind, self.raw, self.shape[1], dtype)

    def blocks(self) -> torch.Tensor:
        """The raw bytes as a writable uint8 tensor [N, row bytes] of its own (the kernels' input)."""
        return torch.from_numpy(np.array(self.raw, dtype=np.uint8, order="C", copy=True))

    def rows(self, ids: torch.Tensor | np.ndarray) -> GGUFWeight:
        """The rows `ids`, in that order (whole rows of blocks: the same bytes)."""
        ids = ids.numpy() if isinstance(ids, torch.Tensor) else ids
        return GGUFWeight(self.kind, np.ascontiguousarray(self.raw[ids]), (len(ids), self.shape[1]))

    def row_slice(self, start: int, end: int) -> GGUFWeight:
        return GGUFWeight(self.kind, np.ascontiguousarray(self.raw[start:end]), (end - start, self.shape[1]))

    def column_slice(self, start: int, end: int) -> GGUFWeight:
        """Inputs [start, end); ValueError unless both ends fall between blocks."""
        b = self.format.block_elems
        if start % b or end % b:
            raise ValueError(f"columns [{start}, {end}) cut {self.kind} blocks of {b} weights")
        size = self.format.block_bytes
        raw = np.ascontiguousarray(self.raw[:, start // b * size : end // b * size])
        return GGUFWeight(self.kind, raw, (self.shape[0], end - start))

    @staticmethod
    def cat(parts: list[GGUFWeight]) -> GGUFWeight:
        """Rows of several weights of one type and row length stacked (fused q/k/v, gate/up)."""
        first = parts[0]
        if any(p.kind != first.kind or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only weights of one GGUF type and row length stack")
        raw = np.concatenate([p.raw for p in parts])
        return GGUFWeight(first.kind, raw, (sum(p.shape[0] for p in parts), first.shape[1]))

    def release(self) -> None:
        """Drop the file pages this weight's bytes occupy from the process (no-op for a copy)."""
        drop_file_pages(self.raw)


def drop_file_pages(array: np.ndarray) -> None:
    """madvise(DONTNEED) the whole pages under `array` when it is a view of a read-only file map."""
    global _libc
    if not isinstance(array, np.memmap) or getattr(array, "_mmap", None) is None or array.nbytes == 0:
        return
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:  # not Linux-like: keep the pages (only memory, never correctness)
            _libc = False
    if not _libc:
        return
    start = array.ctypes.data
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, (start + array.nbytes) // page * page
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
