"""The GGUF container itself: metadata and the tensor table, the tensor data left in the file's map.

gguf-py's `GGUFReader` parses every metadata value into numpy parts, the vocabulary and merge table
too (one small array per string: for a 49k vocabulary, +180 MB at its peak and seconds of time,
part of it never returned to the OS). Loading needs none of those strings (the tokenizer reads them
itself, model/tokenizer_files.py), so this reader walks over string arrays, keeping their length
(the vocabulary size of files without `vocab_size`). Tensor data are views of one read-only memory
map per file: nothing is read until a tensor is converted.

A model may come split over several files (llama.cpp's gguf-split, gguf-py's writer with a split
size: `NAME-00001-of-00003.gguf`, ...; large quantized models are published so): the first holds the
metadata, every file holds some tensors and `split.no` / `split.count`. Loading the first file reads
them all, as llama.cpp does.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from tokenmill.model.gguf_parts import part_path, split_name
from tokenmill.model.quant_formats.registry import format_by_id

_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# metadata value types with a fixed width: (struct format, bytes)
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: str  # GGUF type name ("Q4_K", "F32", ...)
    shape: tuple[int, ...]  # torch order (slowest dimension first)
    data: np.ndarray  # uint8 view of the file's map: the tensor's bytes


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # scalars, strings, numeric arrays as lists; string arrays as their length
    tensors: list[GGUFTensor]


class UnknownTensorType(ValueError):
    """A tensor of a GGML type no table here knows: the file may be whole, but it cannot be read."""


class SplitError(ValueError):
    """A split model's files do not add up: a later part given, a part missing or not of this model."""


def read_gguf(path: str) -> GGUFFile:
    """The model at `path`, with the tensors of every other part of a split model.

    ValueError (or struct.error) on a file that is not whole: a truncated header or tensor data;
    UnknownTensorType for a type id neither gguf-py nor quant_formats knows; SplitError for a split
    model whose parts do not add up."""
    first = _read_one(path)
    count = int(first.metadata.get("split.count", 1))
    if count <= 1:
        return first
    no = int(first.metadata.get("split.no", 0))
    if no != 0:
        raise SplitError(f"{os.path.basename(path)} is part {no + 1} of a model split in {count} files: "
                         f"load the first part ({_part_path(path, 0, count)})")
    tensors = list(first.tensors)
    for i in range(1, count):
        part_file = _part_path(path, i, count)
        if not os.path.isfile(part_file):
            raise SplitError(f"part {i + 1} of {count} of this split model is missing: {part_file}")
        part = _read_one(part_file)
        if int(part.metadata.get("split.no", -1)) != i or int(part.metadata.get("split.count", -1)) != count:
            raise SplitError(f"{part_file} is not part {i + 1} of {count} of {os.path.basename(path)}")
        tensors += part.tensors
    expected = first.metadata.get("split.tensors.count")
    if expected is not None and int(expected) != len(tensors):
        raise SplitError(f"the {count} parts hold {len(tensors)} tensors, the first part says {expected}")
    return GGUFFile(first.metadata, tensors)


def _part_path(path: str, index: int, count: int) -> str:
    """Part `index` (from 0) of the split model whose part `path` is, by llama.cpp's naming."""
    named = split_name(path)
    if named is None or named[2] != count:
        raise SplitError(f"{os.path.basename(path)} says it is one of {count} parts, but its name is not "
                         f"NAME-0000N-of-{count:05d}.gguf, so the other parts cannot be found")
    return part_path(named[0], index, count)


def _read_one(path: str) -> GGUFFile:
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version} (this reader reads versions 2 and 3)")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = _string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, value_type)
    table = []
    for _ in range(tensor_count):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        try:
            qformat = format_by_id(type_id)
        except ValueError as e:
            raise UnknownTensorType(f"tensor {name!r}: {e}") from None
        table.append((name, tuple(int(d) for d in reversed(shape)), qformat, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, shape, qformat, offset in table:
        nbytes = prod(shape) // qformat.block_elems * qformat.block_bytes
        begin = start + offset
        if begin + nbytes > len(blob):
            raise ValueError(f"tensor {name!r} ends at byte {begin + nbytes}, past the file's end ({len(blob)})")
        tensors.append(GGUFTensor(name, qformat.name, shape, blob[begin : begin + nbytes]))
    return GGUFFile(metadata, tensors)


def _string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    end = pos + 8 + length
    if end > len(blob):
        raise ValueError("a string runs past the file's end")
    return bytes(blob[pos + 8 : end]).decode("utf-8"), end


def _value(blob: np.ndarray, pos: int, value_type: int) -> tuple[Any, int]:
    if value_type in _SCALARS:
        fmt, width = _SCALARS[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + width
    if value_type == _STRING:
        return _string(blob, pos)
    if value_type != _ARRAY:
        raise ValueError(f"metadata value of unknown type {value_type}")
    element_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element_type in _SCALARS:
        fmt, width = _SCALARS[element_type]
        return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), pos + count * width
    if element_type == _STRING:  # vocabulary, merges: walked over, only the length kept
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", blob, pos)
            pos += 8 + length
        return count, pos
    values = []  # arrays of arrays: rare, small
    for _ in range(count):
        value, pos = _value(blob, pos, element_type)
        values.append(value)
    return values, pos
