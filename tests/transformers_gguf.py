"""transformers' GGUF loading for the tests' references, without parsing the same file three times.

Loading the bundled SmolLM2 GGUF into transformers (the reference of the fidelity tests) parses its
metadata with gguf-py's `GGUFReader` once for the tokenizer, once for the config and once for the
weights (~5 s each here: the 49k-token vocabulary's arrays are read field by field), and builds
gguf-py's tensor-name map once per module of the model (397 times, ~5 s). Both are functions of their
arguments alone, so inside `shared_gguf_parsing()` transformers gets one reader per file (its arrays
are read-only memory maps of the file) and one name map per (architecture, layer count). What
transformers computes from them is unchanged: the same tokenizer, config and fp32 weights.

Only the reference loads run inside the `with` (tests/real_model.py, tests/tiny_models.py), so
tokenmill's own readers never get a shared one, and nothing stays patched outside it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import gguf

_readers: dict[tuple[str, int, int], gguf.GGUFReader] = {}


def _shared_reader(path: str | os.PathLike, mode: str = "r") -> gguf.GGUFReader:
    if mode != "r":
        return _ORIGINAL_READER(path, mode)
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)  # a rewritten file is parsed anew
    if key not in _readers:
        _readers[key] = _ORIGINAL_READER(path, mode)
    return _readers[key]


_ORIGINAL_READER = gguf.GGUFReader
_ORIGINAL_NAME_MAP = gguf.get_tensor_name_map
_shared_name_map = functools.lru_cache(maxsize=None)(_ORIGINAL_NAME_MAP)


@contextlib.contextmanager
def shared_gguf_parsing() -> Iterator[None]:
    """transformers imports `GGUFReader` and `get_tensor_name_map` from gguf-py at each call, so the
    shared versions are what it finds while this is open."""
    gguf.GGUFReader, gguf.get_tensor_name_map = _shared_reader, _shared_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = _ORIGINAL_READER, _ORIGINAL_NAME_MAP
