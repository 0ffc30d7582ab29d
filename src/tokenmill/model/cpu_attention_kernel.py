"""A fused C++ paged-attention decode kernel for CPU (csrc/paged_attention.cpp), built on first use.

Decode rows read K/V straight from the pages through the block table, instead of gathering every
sequence's pages into padded tensors first (see attention.py); for a large decode batch the gather
was most of a decode step.

The extension is compiled with the system C++ compiler the first time a process asks for it and
cached under ~/.cache/tokenmill/kernels (or $TOKENMILL_CACHE_DIR/kernels), keyed by a hash of the
source, the flags and the torch version; later processes just load the cached library. The binary
does not depend on the build machine's CPU: the kernel carries AVX-512, AVX2 and baseline variants
and picks one at run time. Nothing here may break the engine: when there is no compiler, or the
build or the load fails, a warning is logged once and `available()` says False, so attention falls
back to the PyTorch path. TOKENMILL_DISABLE_CPU_KERNEL=1 forces that fallback.

The build does not go through torch.utils.cpp_extension.load: that needs ninja on PATH and guards
concurrent builds with a lock file that a killed build leaves behind, after which every later load
waits forever. Here each builder compiles to a private temporary file and renames it into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "TOKENMILL_DISABLE_CPU_KERNEL"
_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_BUILD_TIMEOUT_S = 600
_CXXFLAGS = ["-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w"]

_lock = threading.Lock()
_state: bool | None = None  # None: not tried yet; True: loaded; False: unavailable in this process


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def available() -> bool:
    """Whether the kernel can be used now; builds or loads it on the first call of the process."""
    if disabled():
        return False
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
    return _state


def paged_decode_attention(
    q: torch.Tensor,  # [nd, num_heads, head_dim] float32
    k_cache: torch.Tensor,  # [num_kv_heads, num_pages * page_size, head_dim] float32 or bfloat16
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [nd, max_pages] int64 or int32
    seq_lens: torch.Tensor,  # [nd] tokens of context of each row, including its own token
    page_size: int,
    scale: float,
    isa: int = -1,  # tests: at most 0 baseline, 1 AVX2, 2 AVX-512; -1: the best the CPU has
) -> torch.Tensor:  # [nd, num_heads, head_dim] float32
    """Attention of one query token per sequence over its cached positions 0..seq_lens[i]-1."""
    if not available():
        raise RuntimeError("the CPU paged-attention kernel is not available")
    op = torch.ops.tokenmill_cpu.paged_decode_attention
    return op(q, k_cache, v_cache, block_table, seq_lens, page_size, scale, isa)


def best_isa() -> int:
    """The variant the kernel runs on this CPU: 0 baseline x86-64 (or not x86), 1 AVX2, 2 AVX-512."""
    if not available():
        raise RuntimeError("the CPU paged-attention kernel is not available")
    return torch.ops.tokenmill_cpu.best_isa()


def _cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill" / "kernels"


def _build_command(source: Path, output: Path, compiler: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = [compiler, *_CXXFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
    for path in include_paths():
        cmd += ["-isystem", path]
    # libgomp: the soname torch's own copy already loaded has, so the process keeps one OpenMP runtime.
    cmd += [str(source), "-o", str(output), f"-L{torch_lib}", "-lc10", "-ltorch_cpu"]
    return cmd


def _load() -> bool:
    if not sys.platform.startswith("linux"):
        logger.info("CPU attention kernel: only built on Linux; using the PyTorch path")
        return False
    try:
        source = _SOURCE.read_bytes()
        compiler = os.environ.get("CXX") or "c++"
        key_parts = [source, " ".join(_CXXFLAGS).encode(), torch.__version__.encode(), compiler.encode(),
                     sys.platform.encode(), os.uname().machine.encode()]
        key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
        folder = _cache_dir() / f"paged_attention-{key}"
        library = folder / "paged_attention.so"
        if not library.exists():
            if shutil.which(compiler) is None:
                logger.warning("CPU attention kernel: no C++ compiler (%r) found; using the PyTorch path", compiler)
                return False
            _build(folder, library, compiler)
        torch.ops.load_library(str(library))
        return True
    except Exception as exc:  # any failure means: fall back, never break the engine
        logger.warning("CPU attention kernel unavailable (%s); using the PyTorch path", exc)
        return False


def _build(folder: Path, library: Path, compiler: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # Concurrent builders (several processes starting at once) each write a private file; the last
    # rename wins and every renamed file is complete, so no lock is needed.
    tmp = folder / f".paged_attention.{os.getpid()}.{threading.get_ident()}.so"
    cmd = _build_command(_SOURCE, tmp, compiler)
    logger.warning("building the CPU attention kernel (once; about half a minute) in %s", folder)
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
    logger.info("built the CPU attention kernel in %.1fs", time.monotonic() - start)
