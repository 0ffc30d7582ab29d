"""Wrappers of the C++ quantized-linear kernels, built on first use.

Two layouts: the row layout (csrc/quant_linear.cpp: `linear`, `dequantize`), for weights whose row
count is not a multiple of 16 and CPUs without AVX2; and the column-blocked layout every GGUF block
type is re-laid into (`blocked_*`), run by csrc/quant_vnni.h on AVX512-VNNI CPUs and by
csrc/quant_avx2.h on AVX2 ones (same ops, same layout: `blocked_kernel` says which). For large
batches a oneDNN GEMM over a just-dequantized copy beats any matrix-vector kernel. When an extension
cannot be built, its `available()` is False and model/layers/quantized_linear.py falls back to
PyTorch. TOKENMILL_DISABLE_CPU_KERNEL=1 disables them, like the attention kernel.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.model.kernels import weight_scratch
from tokenmill.model.kernels.cpp_build import LazyExtension
from tokenmill.model.quant import BlockedWeight, QuantizedWeight

logger = logging.getLogger(__name__)

_ROW = LazyExtension("quant_linear", "CPU quantized-linear kernel", logger)
_VNNI = LazyExtension("quant_vnni", "CPU VNNI quantized-linear kernel", logger)
_AVX2 = LazyExtension("quant_avx2", "CPU AVX2 quantized-linear kernel", logger)
_EMPTY = torch.empty(0, dtype=torch.float16)


def available() -> bool:
    return _ROW.available()


def vnni_available() -> bool:
    """Whether the column-blocked AVX512-VNNI kernel (csrc/quant_vnni.h) runs on this CPU."""
    return available() and _VNNI.available() and bool(torch.ops.tokenmill_vnni.supported())


def avx2_blocked_available() -> bool:
    """Whether the column-blocked AVX2 kernel (csrc/quant_avx2.h) runs on this CPU."""
    return _AVX2.available() and bool(torch.ops.tokenmill_avx2.supported())


def blocked_kernel() -> str | None:
    """Which kernel runs column-blocked weights here: "vnni", "avx2", or None (no blocked kernel)."""
    if vnni_available():
        return "vnni"
    return "avx2" if avx2_blocked_available() else None


def _blocked_ops():
    return torch.ops.tokenmill_vnni if blocked_kernel() == "vnni" else torch.ops.tokenmill_avx2


def blocked_args(w: BlockedWeight) -> tuple:
    """A blocked weight as the VNNI ops take it: codes, scales, mins, subs, format id, N."""
    return (w.codes, w.scales, or_empty(w.mins), or_empty(w.subs), w.fmt, w.shape[0])


def amx_available() -> bool:
    """Whether two-term steps of many rows run on AMX-BF16 tiles here (csrc/quant_amx.h)."""
    return vnni_available() and bool(torch.ops.tokenmill_vnni.amx_supported())


def amx_min_rows() -> int:
    """From how many rows two-term steps take the AMX-BF16 tiles (where amx_available())."""
    return int(torch.ops.tokenmill_vnni.amx_min_rows())


def vec_available() -> bool:
    """Whether Q8_0 steps of vec_min_rows()+ rows run the AMX tiles' one-term products on AVX512-BF16's
    vector dot products here (csrc/quant_bf16_vec.h: bf16 dot products and no AMX, e.g. AMD Zen 4)."""
    return vnni_available() and bool(torch.ops.tokenmill_vnni.vec_supported())


def vec_min_rows() -> int:
    """From how many rows Q8_0 steps take those products (where vec_available())."""
    return int(torch.ops.tokenmill_vnni.vec_min_rows())


def amx8_available() -> bool:
    """Whether two-term steps of a few dozen rows of the super-block formats run on AMX-INT8 tiles here
    (csrc/quant_amx8.h)."""
    return vnni_available() and bool(torch.ops.tokenmill_vnni.amx8_supported())


def blocked_linear(x: torch.Tensor, w: BlockedWeight, terms: int = 2, amx: bool = True,
                   two_tile_terms: bool = False) -> torch.Tensor:
    """terms: int8 terms per activation (2: ~15 bits, near fp32 quality; 1: llama.cpp's Q8). amx=False
    keeps two-term steps of many rows on the VNNI kernel where they would take AMX tiles (tests of the
    VNNI arithmetic). two_tile_terms: those tiles multiply both bf16 terms of x for every format
    (Q8_0 and Q6_K take one by default: csrc/quant_amx.h `kTerms`)."""
    if blocked_kernel() == "vnni":
        return torch.ops.tokenmill_vnni.linear(x, *blocked_args(w), terms, amx, two_tile_terms)
    return _blocked_ops().linear(x, *blocked_args(w), terms)


def blocked_linear_amx(x: torch.Tensor, w: BlockedWeight, two_tile_terms: bool = False) -> torch.Tensor:
    """x @ w.T on AMX-BF16 tiles at any row count (where amx_available())."""
    return torch.ops.tokenmill_vnni.linear_amx(x, *blocked_args(w), two_tile_terms)


def blocked_linear_amx8(x: torch.Tensor, w: BlockedWeight) -> torch.Tensor:
    """x @ w.T on AMX-INT8 tiles (where amx8_available()), 1-64 rows of a format that folds its sub-block
    scales (Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)."""
    return torch.ops.tokenmill_vnni.linear_amx8(x, *blocked_args(w))


def bound_blocked_linear(w: BlockedWeight, terms: int = 2, two_tile_terms: bool = False):
    """`blocked_linear` with the weight's arguments bound: x -> x @ w.T (the decode hot path)."""
    op = _blocked_ops().linear.default
    args = (*blocked_args(w), terms)
    if two_tile_terms and blocked_kernel() == "vnni":  # the AVX2 kernel has no tiles
        args = (*args, True, True)
    return lambda x: op(x, *args)


def bound_blocked_silu_mul(w: BlockedWeight):
    """x -> silu(x @ gate.T) * (x @ up.T) for a gate and up projection stacked in `w` (the gate's rows
    first), the activation fused into the AMX-BF16 tiles' sums (csrc/quant_amx.h `multiply_silu_mul`),
    for steps of amx_min_rows()+ rows; None where that does not run here (no AMX tiles, Q2_K's units
    of 16, more than 1,536 inputs: more than one span of the tiles)."""
    if not amx_available() or not torch.ops.tokenmill_vnni.silu_mul_fuses(w.fmt, w.shape[0], w.shape[1]):
        return None
    op = torch.ops.tokenmill_vnni.linear_silu_mul.default
    args = blocked_args(w)
    return lambda x: op(x, *args)


def tiles_min_rows() -> int:
    """From how many rows a step's one-term formats take tiles: the AMX tiles' amx_min_rows(), else the
    vector tiles' vec_min_rows()."""
    return amx_min_rows() if amx_available() else vec_min_rows()


def tiles_take_bf16(w: BlockedWeight, two_tile_terms: bool = False) -> bool:
    """Whether the tiles (steps of tiles_min_rows()+ rows) read a bfloat16 input of `w` as it is, with
    the same results as its float32 values: formats whose tiles take hi = bf16(x) alone and have no
    mins (AMX: Q8_0, Q6_K, csrc/quant_amx_calls.h `needs_of`; the vector tiles without AMX: Q8_0).
    False where there are no tiles."""
    if blocked_kernel() != "vnni" or not (amx_available() or vec_available()):
        return False
    return bool(torch.ops.tokenmill_vnni.tiles_take_bf16(*blocked_args(w), w.shape[1], two_tile_terms))


def bound_blocked_linear_parts(ws: list[BlockedWeight], terms: int = 2):
    """x -> [x @ w.T for w in ws] side by side in one float32 output, x rounded once (a fused q/k/v
    whose parts are in different formats: csrc/quant_vnni.cpp `linear_parts`)."""
    op = _blocked_ops().linear_parts.default
    tensors = [t for w in ws for t in (w.codes, w.scales, or_empty(w.mins), or_empty(w.subs))]
    fmts, ns = [w.fmt for w in ws], [w.shape[0] for w in ws]
    return lambda x: op(x, tensors, fmts, ns, terms)


def blocked_dequantize_bf16(w: BlockedWeight) -> torch.Tensor:
    """The dense bf16 [N, K] matrix: gguf-py's values rounded once to bf16."""
    if blocked_kernel() != "vnni":
        return blocked_dequantize_fp32(w).bfloat16()
    return torch.ops.tokenmill_vnni.dequantize_bf16(*blocked_args(w), w.shape[1])


def blocked_dequantize_fp32(w: BlockedWeight) -> torch.Tensor:
    """The dense fp32 [N, K] matrix: gguf-py's values exactly."""
    if blocked_kernel() != "vnni":
        return torch.ops.tokenmill_avx2.dequantize(*blocked_args(w), w.shape[1])
    return blocked_rows(w, torch.arange(w.shape[0]))


def blocked_dense_scratch(w: BlockedWeight, dtype: torch.dtype) -> torch.Tensor:
    """`w` as a dense [N, K] matrix of `dtype` (bf16 or fp32: the values of blocked_dequantize_*) in this
    thread's weight scratch (weight_scratch.py): valid until the thread's next scratch copy, for a GEMM
    that reads it right away."""
    out = weight_scratch.take(w.shape[0], w.shape[1], dtype)
    if dtype == torch.bfloat16 and blocked_kernel() == "vnni":
        torch.ops.tokenmill_vnni.dequantize_bf16_into(out, *blocked_args(w), w.shape[1])
    elif dtype == torch.float32 and blocked_kernel() == "avx2":
        torch.ops.tokenmill_avx2.dequantize_into(out, *blocked_args(w), w.shape[1])
    else:  # the rarer pairs (AVX2 forced to bf16; fp32 on VNNI): as the allocating ops do it
        out.copy_(blocked_dequantize_bf16(w) if dtype == torch.bfloat16 else blocked_dequantize_fp32(w))
    return out


def blocked_rows(w: BlockedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` as fp32 [T, K], gguf-py's values exactly (embedding lookups)."""
    return bound_blocked_rows(w)(ids)


def bound_blocked_rows(w: BlockedWeight):
    """`blocked_rows` with the weight's arguments bound: ids -> rows (each decode step's embedding lookup,
    without the kernel checks `_blocked_ops` makes on every call)."""
    op = _blocked_ops().dequantize_rows.default
    args = (*blocked_args(w), w.shape[1])
    return lambda ids: op(*args, ids)


def or_empty(t: torch.Tensor | None) -> torch.Tensor:
    """A weight's optional mins (or subs) as the kernels take them: an empty tensor for none."""
    return _EMPTY if t is None else t


def linear(x: torch.Tensor, w: QuantizedWeight, isa: int = -1) -> torch.Tensor:
    """x [M, K] float32 @ w.T -> [M, N] float32. isa (tests): at most 0 portable, 1 AVX2, 2 AVX-512."""
    mins = or_empty(w.mins)
    return torch.ops.tokenmill_quant.linear(x, w.codes, w.scales, mins, w.bits, isa)


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    mins = or_empty(w.mins)
    return torch.ops.tokenmill_quant.dequantize(w.codes, w.scales, mins, w.bits, w.shape[1], dtype == torch.bfloat16)


def dense_scratch(w: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`dequantize(w, dtype)` in this thread's weight scratch (see blocked_dense_scratch)."""
    out = weight_scratch.take(w.shape[0], w.shape[1], dtype)
    torch.ops.tokenmill_quant.dequantize_into(out, w.codes, w.scales, or_empty(w.mins), w.bits, w.shape[1])
    return out


def best_isa() -> int:
    return torch.ops.tokenmill_quant.best_isa()
