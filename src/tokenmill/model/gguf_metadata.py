"""Reads a GGUF file's key-value metadata alone (no tensor index), arrays included; and, for Ollama's
listings, with the weights its tensor table counts (`read_gguf_metadata_and_parameters`).

gguf-py's GGUFReader makes one numpy part per element of every array: for a 262,144-token
vocabulary (tokens, scores, types) that took close to a minute on a loaded 2-core machine. Here
numeric arrays are one `numpy.frombuffer` each and strings are decoded in one pass over the header.
`write_metadata_only` copies that header alone, for readers that must not see the tensor table.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_HEADER_BYTES = 24  # magic, version, tensor count, key-value count
GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """Every metadata key: scalars as Python values, strings as str, numeric arrays as numpy arrays,
    string arrays as lists of str."""
    with open(path, "rb") as f:
        _, count = _counts(f)
        reader = _Reader(f)
        return {reader.string(): reader.value(reader.u32()) for _ in range(count)}


def read_gguf_metadata_and_parameters(path: str) -> tuple[dict[str, Any], int]:
    """read_gguf_metadata's keys, and the weights the tensor table after them counts (every tensor's
    elements), in one pass over the header."""
    with open(path, "rb") as f:
        tensors, count = _counts(f)
        reader = _Reader(f)
        meta = {reader.string(): reader.value(reader.u32()) for _ in range(count)}
        total = 0
        for _ in range(tensors):
            reader.string()
            total += int(np.prod([reader.u64() for _ in range(reader.u32())], dtype=np.int64))
            reader.u32(), reader.u64()  # type, offset
        return meta, total


def write_metadata_only(path: str, dest: str) -> None:
    """`dest`: a GGUF file with `path`'s metadata and no tensors. transformers builds a GGUF's
    tokenizer through gguf-py's GGUFReader, which also parses the tensor table and refuses a file
    holding a type it does not know (a newer llama.cpp's Q2_0): the tokenizer needs the metadata only."""
    with open(path, "rb") as f:
        _, count = _counts(f)
        reader = _Reader(f)
        for _ in range(count):
            reader.string()
            reader.value(reader.u32())
        end = f.tell()
        f.seek(0)
        magic_and_version = f.read(8)
        f.seek(_HEADER_BYTES)
        body = f.read(end - _HEADER_BYTES)
    with open(dest, "wb") as out:
        out.write(magic_and_version + struct.pack("<QQ", 0, count) + body)


def _counts(f) -> tuple[int, int]:
    """The header's tensor and key-value counts, leaving `f` at the first key (ValueError if not a GGUF)."""
    head = f.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[:4] != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    return struct.unpack_from("<QQ", head, 8)


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
