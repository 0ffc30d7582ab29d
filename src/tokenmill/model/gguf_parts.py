"""Model file names: the parts of a GGUF model split into several files (llama.cpp's gguf-split:
NAME-00001-of-00003.gguf), and the name a model is served under by default.

Why a file of its own: the loader follows these names to a split model's other parts
(model/gguf_file.py); the API server's model list (frontend/model_router.py) shows a split model
once, by its first part, and counts all its parts' bytes; the scheduler and the API server must
agree on a model's default name. The server's API process stays free of numpy and torch, so the
rules sit here, in the standard library alone.
"""

from __future__ import annotations

import os
import re

# llama.cpp's `llama_split_path`: PREFIX-%05d-of-%05d.gguf, parts counted from 1
_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_name(path: str) -> tuple[str, int, int] | None:
    """(prefix, part number from 1, part count) if `path` is named as a part of a split model."""
    m = _SPLIT_NAME.match(path)
    if m is None or int(m["count"]) < 1:
        return None
    return m["prefix"], int(m["no"]), int(m["count"])


def part_path(prefix: str, index: int, count: int) -> str:
    """Part `index` (from 0) of the split model `prefix`."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def all_parts(path: str) -> list[str]:
    """Every part's path of the split model whose first part `path` is; [path] for any other file."""
    named = split_name(path)
    if named is None or named[1] != 1:
        return [path]
    prefix, _, count = named
    return [part_path(prefix, i, count) for i in range(count)]


def is_later_part(path: str) -> bool:
    """A part other than the first: not a model to list on its own."""
    named = split_name(os.path.basename(path))
    return named is not None and named[1] > 1


def default_model_name(path: str) -> str:
    """The name a model is served under when none is given: the file's or folder's name without
    `.gguf`, a split model's without its part suffix (NAME-00001-of-00003.gguf -> NAME)."""
    base = os.path.basename(os.path.normpath(path))
    named = split_name(base)
    if named is not None:
        return named[0]
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
