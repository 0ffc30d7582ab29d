"""Where tokenmill keeps what it builds once and reuses across processes and runs (compiled kernels,
exported tokenizers): $TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill.
Torch-free: the server's text processes use it too."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill"
