"""A model file's identity without reading it: (size, mtime_ns) of the path, and of a folder's
config.json. What is remembered about a file (a failed load, its metadata) is keyed by it, so a
changed or replaced file is looked at again."""

from __future__ import annotations

import os

FileStamp = tuple[tuple[int, int], ...] | None


def file_stamp(path: str) -> FileStamp:
    """None if the path does not exist."""
    stamps = []
    for p in (path, os.path.join(path, "config.json")) if os.path.isdir(path) else (path,):
        try:
            st = os.stat(p)
        except OSError:
            if p == path:
                return None
            continue
        stamps.append((st.st_size, st.st_mtime_ns))
    return tuple(stamps)
