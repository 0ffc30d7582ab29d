"""Builds and loads one C++ torch extension from model/csrc/, cached across processes.

An extension is compiled with the system C++ compiler the first time a process asks for it and
cached under ~/.cache/tokenmill/kernels (or $TOKENMILL_CACHE_DIR/kernels), keyed by a hash of the
source, the flags and the torch version; later processes just load the cached library. Binaries do
not depend on the build machine's CPU: kernels carry per-ISA variants chosen at run time.

Nothing here may break the engine: when there is no compiler, or the build or the load fails, one
warning is logged and `load_extension` returns False, so the caller falls back to PyTorch.

The build does not go through torch.utils.cpp_extension.load: that needs ninja on PATH and guards
concurrent builds with a lock file that a killed build leaves behind, after which every later load
waits forever. Here each builder compiles to a private temporary file and renames it into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tokenmill.cache_root import cache_root

CSRC = Path(__file__).resolve().parent.parent / "csrc"
_BUILD_TIMEOUT_S = 600
_CXXFLAGS = ["-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w"]


class LazyExtension:
    """One extension, built or loaded on the first `available()` of the process (thread-safe); False
    where it cannot be, or while TOKENMILL_DISABLE_CPU_KERNEL is set."""

    def __init__(self, name: str, what: str, logger: logging.Logger) -> None:
        self.name, self.what, self.logger = name, what, logger
        self._lock = threading.Lock()
        self._state: bool | None = None

    def available(self) -> bool:
        if os.environ.get("TOKENMILL_DISABLE_CPU_KERNEL", "").strip().lower() not in ("", "0", "false", "no"):
            return False
        if self._state is None:
            with self._lock:
                if self._state is None:
                    self._state = load_extension(self.name, self.what, self.logger)
        return self._state


def cache_dir() -> Path:
    return cache_root() / "kernels"


def build_command(source: Path, output: Path, compiler: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = [compiler, *_CXXFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
    for path in include_paths():
        cmd += ["-isystem", path]
    # libgomp: the soname torch's own copy already loaded has, so the process keeps one OpenMP runtime.
    cmd += [str(source), "-o", str(output), f"-L{torch_lib}", "-lc10", "-ltorch_cpu"]
    return cmd


def local_headers(source: bytes, seen: set[str] | None = None) -> list[bytes]:
    """The csrc/ headers `source` includes, directly or through each other: part of the cache key,
    since kernels share their code through them."""
    seen = set() if seen is None else seen
    out: list[bytes] = []
    for name in re.findall(rb'^#include "([\w.]+)"', source, re.M):
        if name.decode() not in seen:
            seen.add(name.decode())
            text = (CSRC / name.decode()).read_bytes()
            out += [text, *local_headers(text, seen)]
    return out


def load_extension(name: str, what: str, logger: logging.Logger) -> bool:
    """Build (once) and load csrc/{name}.cpp; `what` names it in log lines. False: use the fallback."""
    if not sys.platform.startswith("linux"):
        logger.info("%s: only built on Linux; using the PyTorch path", what)
        return False
    try:
        source_path = CSRC / f"{name}.cpp"
        source = source_path.read_bytes()
        compiler = os.environ.get("CXX") or "c++"
        key_parts = [source, *local_headers(source), " ".join(_CXXFLAGS).encode(), torch.__version__.encode(), compiler.encode(),
                     sys.platform.encode(), os.uname().machine.encode()]
        key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
        folder = cache_dir() / f"{name}-{key}"
        library = folder / f"{name}.so"
        if not library.exists():
            if shutil.which(compiler) is None:
                logger.warning("%s: no C++ compiler (%r) found; using the PyTorch path", what, compiler)
                return False
            _build(source_path, folder, library, compiler, what, logger)
        torch.ops.load_library(str(library))
        return True
    except Exception as exc:  # any failure means: fall back, never break the engine
        logger.warning("%s unavailable (%s); using the PyTorch path", what, exc)
        return False


def _build(source: Path, folder: Path, library: Path, compiler: str, what: str, logger: logging.Logger) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # Concurrent builders (several processes starting at once) each write a private file; the last
    # rename wins and every renamed file is complete, so no lock is needed.
    tmp = folder / f".{library.stem}.{os.getpid()}.{threading.get_ident()}.so"
    cmd = build_command(source, tmp, compiler)
    logger.warning("building the %s (once; about half a minute) in %s", what, folder)
    start = time.monotonic()
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False)
        if result.returncode != 0:
            (folder / "build.log").write_text(" ".join(cmd) + "\n\n" + result.stdout + result.stderr)
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"compiler exited with {result.returncode}: {' | '.join(tail)}")
        os.replace(tmp, library)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("built the %s in %.1fs", what, time.monotonic() - start)
