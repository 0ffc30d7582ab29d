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
# -fno-trapping-math: no kernel reads floating-point exception flags, and without it GCC does not
# if-convert a select followed by arithmetic that may trap in an AVX2 loop (no masks there): SiLU's
# exp stayed scalar in the fused ops' AVX2 variant (6.1 us a 1,536-wide row; 3.2 with the flag, 2.0
# on AVX-512). It changes which loops vectorise, not what any operation computes.
_CXXFLAGS = ["-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-fno-trapping-math", "-w"]


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


def library_path(name: str, compiler: str) -> Path:
    """Where csrc/{name}.cpp's library is cached: a folder keyed by its source, the headers it
    includes, the flags, torch's version, the compiler and the platform."""
    source = (CSRC / f"{name}.cpp").read_bytes()
    key_parts = [source, *local_headers(source), " ".join(_CXXFLAGS).encode(), torch.__version__.encode(), compiler.encode(),
                 sys.platform.encode(), os.uname().machine.encode()]
    key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}" / f"{name}.so"


def ensure_built(name: str, what: str, logger: logging.Logger) -> Path | None:
    """csrc/{name}.cpp's cached library, built first if missing; None (one warning) where it cannot be."""
    if not sys.platform.startswith("linux"):
        logger.info("%s: only built on Linux; using the PyTorch path", what)
        return None
    try:
        compiler = os.environ.get("CXX") or "c++"
        library = library_path(name, compiler)
        if not library.exists():
            if shutil.which(compiler) is None:
                logger.warning("%s: no C++ compiler (%r) found; using the PyTorch path", what, compiler)
                return None
            _build(CSRC / f"{name}.cpp", library.parent, library, compiler, what, logger)
        return library
    except Exception as exc:  # any failure means: fall back, never break the engine
        logger.warning("%s unavailable (%s); using the PyTorch path", what, exc)
        return None


def load_extension(name: str, what: str, logger: logging.Logger) -> bool:
    """Build (once) and load csrc/{name}.cpp; `what` names it in log lines. False: use the fallback."""
    library = ensure_built(name, what, logger)
    if library is None:
        return False
    try:
        torch.ops.load_library(str(library))
        return True
    except Exception as exc:  # any failure means: fall back, never break the engine
        logger.warning("%s unavailable (%s); using the PyTorch path", what, exc)
        return False


def build_all(jobs: int, logger: logging.Logger) -> dict[str, bool]:
    """Builds every csrc/*.cpp whose library is not cached yet, `jobs` compilers at a time (each
    build is one single-threaded compiler run of 20 s to 2 min; on first use they would run one after
    another). Nothing is loaded. Returns, per extension, whether its library is there now."""
    from concurrent.futures import ThreadPoolExecutor

    # Largest sources (with their headers) first: decode_step and paged_attention take 1-3 minutes
    # each, the others seconds, so on two cores the long ones start at once.
    def size(name: str) -> int:
        source = (CSRC / f"{name}.cpp").read_bytes()
        return len(source) + sum(map(len, local_headers(source)))

    names = sorted((p.stem for p in CSRC.glob("*.cpp")), key=size, reverse=True)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        built = pool.map(lambda n: ensure_built(n, f"{n} kernel", logger) is not None, names)
        return dict(zip(names, built))


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenmill.model.kernels.cpp_build [--jobs N]`: builds the kernels ahead of their first
    use (`make kernels` does, before `make test`, `serve` and `run`, so a fresh machine's first test or
    server does not wait for them one by one). Exit status 0 even where one cannot be built: the engine then runs that part in PyTorch."""
    import argparse

    parser = argparse.ArgumentParser(description="build the C++ kernels ahead of their first use")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compilers at a time")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    result = build_all(args.jobs, logging.getLogger("tokenmill.kernels"))
    missing = [name for name, ok in result.items() if not ok]
    print(f"kernels: {len(result) - len(missing)} of {len(result)} ready in {time.monotonic() - start:.0f} s"
          + (f" (not built: {', '.join(missing)}; those parts run in PyTorch)" if missing else ""))
    return 0


def _build(source: Path, folder: Path, library: Path, compiler: str, what: str, logger: logging.Logger) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # Concurrent builders (several processes starting at once) each write a private file; the last
    # rename wins and every renamed file is complete, so no lock is needed.
    tmp = folder / f".{library.stem}.{os.getpid()}.{threading.get_ident()}.so"
    cmd = build_command(source, tmp, compiler)
    logger.warning("building the %s (once per source and machine; up to a few minutes) in %s", what, folder)
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


if __name__ == "__main__":
    sys.exit(main())
