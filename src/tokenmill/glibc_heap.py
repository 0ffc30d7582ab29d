"""glibc's malloc controls through ctypes, for any layer that needs them: the engine's heap trims and
step thresholds (engine/memory_trim.py) and the model's move onto huge pages (model/huge_pages.py).

Where glibc is not the C allocator (musl, macOS) `glibc` is None and every call here does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any


def _load_glibc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim or tune
        return None
    return libc


glibc = _load_glibc()


def malloc_trim() -> bool:
    """Return freed heap (all arenas) to the OS; False where glibc is not the allocator."""
    return bool(glibc is not None and glibc.malloc_trim(0))
