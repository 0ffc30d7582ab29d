"""A fused C++ paged-attention decode kernel for CPU (csrc/paged_attention.h), built on first use.

Decode rows read K/V straight from the pages through the block table, instead of gathering every
sequence's pages into padded tensors first (see attention.py); for a large decode batch the gather
was most of a decode step.

It is built and cached by model/kernels/cpp_build.py (once per machine, a few minutes; `make kernels`). The
kernel carries AVX-512 (with and without AVX512-BF16), AVX2 and baseline variants and picks one at run time. When it cannot be
built or loaded, a warning is logged once and `available()` says False, so attention falls back to
the PyTorch path. TOKENMILL_DISABLE_CPU_KERNEL=1 forces that fallback.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from tokenmill.model.kernels.cpp_build import load_extension

logger = logging.getLogger(__name__)

DISABLE_ENV = "TOKENMILL_DISABLE_CPU_KERNEL"

# Cascade attention (csrc/cascade_attention.h): a step's decode rows that share a prefix attend it
# once on AMX tiles where the CPU has them, from (rows, shared prefix tokens) on, by the cache's dtype
# and by where the rows run. Measured on SmolLM2's heads (docs/benchmarks.md): the fused decode step
# gains from 12 rows with bf16 K/V, 16 with int8 (its prefix rows are decoded for the tiles, where the
# rows' own loop reads half the bytes), at 256 tokens; the op (a mixed step's decode rows, three more
# thread forks a layer) only from 16 / 32 rows at 512. TOKENMILL_CASCADE=0 (read at start) turns it
# off: the A/B there.
CASCADE_ENV = "TOKENMILL_CASCADE"
CASCADE_FUSED = {torch.bfloat16: (12, 256), torch.int8: (16, 256)}
CASCADE_OP = {torch.bfloat16: (16, 512), torch.int8: (32, 512)}
_CASCADE_OFF = os.environ.get(CASCADE_ENV, "").strip() == "0"


def cascade_thresholds(cache_dtype: torch.dtype, fused_step: bool = False) -> tuple[int, int]:
    """(min rows, min shared prefix tokens) for cascade attention over a cache of this dtype, in the
    fused decode step or the op; rows 0: never (fp32 caches, or TOKENMILL_CASCADE=0)."""
    if _CASCADE_OFF:
        return 0, 0
    return (CASCADE_FUSED if fused_step else CASCADE_OP).get(cache_dtype, (0, 0))


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
    isa: int = -1,  # tests: at most 0 baseline, 1 AVX2, 2 AVX-512, 3 AVX-512 + bf16 pairs in runs; -1: the best
    window: int | None = None,  # sliding window in tokens (None: none)
    softcap: float | None = None,  # scores capped as softcap * tanh(score / softcap) (None: none)
    cascade: tuple[int, int] | None = None,  # (min rows, min prefix) of cascade attention; None: cascade_thresholds
) -> torch.Tensor:  # [nd, num_heads, head_dim] float32
    """Attention of one query token per sequence over its cached positions 0..seq_lens[i]-1, or
    under a window the last `window` of them (the table's entries of pages wholly before those are
    never read). Rows sharing a prefix of whole pages may attend it once on AMX tiles (cascade)."""
    # Loaded: skip available()'s environment lookup, ~7 us x 30 layers of every step.
    if _state is not True and not available():
        raise RuntimeError("the CPU paged-attention kernel is not available")
    op = torch.ops.tokenmill_cpu.paged_decode_attention
    min_rows, min_prefix = cascade_thresholds(k_cache.dtype) if cascade is None else cascade
    return op(q, k_cache, v_cache, block_table, seq_lens, page_size, scale, isa, window or 0, softcap or 0.0, min_rows,
              min_prefix)


def best_isa() -> int:
    """The variant the kernel runs on this CPU: 0 baseline x86-64 (or not x86), 1 AVX2, 2 AVX-512, 3 AVX-512
    with AVX512-BF16 (runs over bf16 / int8 caches multiply bf16 pairs: csrc/paged_attention_pairs.h)."""
    if not available():
        raise RuntimeError("the CPU paged-attention kernel is not available")
    return torch.ops.tokenmill_cpu.best_isa()


def _load() -> bool:
    return load_extension("paged_attention", "CPU attention kernel", logger)
