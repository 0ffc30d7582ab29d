"""One reusable buffer per thread for the dense copy of a quantized weight that a large step's GEMM reads.

Why: a prompt step of many rows dequantizes each quantized weight it multiplies to a dense bf16 (fp32
on AVX2) matrix for oneDNN's GEMM, and drops it right after. A fresh allocation that large is
mmapped by glibc and unmapped on free, so every step faulted each 4 kB page of every weight back in,
one by one (~1.3 us a fault on this VM): on a model of Llama 3 8B's shape, 3.4 million faults (13.3 GB)
in one 256-token prompt, 4.4 s of its 9.8 (docs/benchmarks.md, "A prompt's weight copies"). A buffer
kept by the thread is faulted in once; each step writes over it.

The buffer grows to the largest weight asked for (a gate/up pair on most models) and stays until
`release()`, which the engine calls whenever its last request has finished (engine/engine_core.py):
it lives while requests run. A view handed out stays valid while it is referenced, so a release never
pulls memory from under a GEMM.
Buffers are keyed by thread id: a thread started after another ended may get its id, and then takes
over its buffer, so threads that come and go never pile buffers up.
Only the caller that consumes the copy before its thread asks for another may take it: a layer's
prompt GEMM, never a weight kept for later.
"""

from __future__ import annotations

import threading

import torch

_buffers: dict[int, torch.Tensor] = {}  # thread id -> bytes
_lock = threading.Lock()


def take(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous [rows, cols] tensor of `dtype` over this thread's buffer (contents undefined),
    valid until this thread's next `take`."""
    nbytes = rows * cols * dtype.itemsize
    key = threading.get_ident()
    with _lock:
        buf = _buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = _buffers[key] = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes].view(dtype).view(rows, cols)


def held_bytes() -> int:
    """Bytes the buffers of all threads hold."""
    with _lock:
        return sum(buf.numel() for buf in _buffers.values())


def release() -> int:
    """Drop every thread's buffer (views still in use keep theirs alive until they are done); returns
    the bytes dropped."""
    with _lock:
        dropped = sum(buf.numel() for buf in _buffers.values())
        _buffers.clear()
    return dropped
