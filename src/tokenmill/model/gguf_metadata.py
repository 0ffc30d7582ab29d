"""Reads a GGUF file's key-value metadata alone (no tensor index), arrays included.

gguf-py's GGUFReader makes one numpy part per element of every array: for a 262,144-token
vocabulary (tokens, scores, types) that took close to a minute on a loaded 2-core machine. Here
numeric arrays are one `numpy.frombuffer` each and strings are decoded in one pass over the header.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """Every metadata key: scalars as Python values, strings as str, numeric arrays as numpy arrays,
    string arrays as lists of str."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        (count,) = struct.unpack_from("<Q", head, 16)
        reader = _Reader(f)
        return {reader.string(): reader.value(reader.u32()) for _ in range(count)}


class _Reader:
    def __init__(self, f) -> None:
        self.f = f

    def u32(self) -> int:
        return struct.unpack("<I", self.f.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.f.read(8))[0]

    def string(self) -> str:
        return self.f.read(self.u64()).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.u32(), self.u64()
            if item == _STRING:
                return [self.string() for _ in range(n)]
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            dtype = np.dtype(_NUMPY[item])
            return np.frombuffer(self.f.read(dtype.itemsize * n), dtype=dtype)
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, self.f.read(struct.calcsize(fmt)))[0]
