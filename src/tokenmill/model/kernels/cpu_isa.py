"""What this process lets its kernels use of the CPU, and whether the CPU multiplies bf16 natively.

TOKENMILL_CPU_ISA (baseline, avx2, avx512 or amx; unset: everything the CPU has) caps every C++ kernel's
run-time choice (csrc/cpu_isa_cap.h reads the same variable): it runs a machine with AVX-512 the way a
CPU without it runs, which is how the AVX2 paths are tested and measured here. A value it does not
know is an error that names it, not a silent default.

`bf16_gemm_native`: oneDNN's bf16 GEMM is ~5x fp32's speed where the CPU has bf16 dot products
(AVX512-BF16, AMX) and ~5x slower where it emulates them (AVX2: 35 against 164 GFLOPS, 2 threads,
docs/benchmarks.md), so the layers take bf16 GEMMs only where it is native and fp32 ones elsewhere.
"""

from __future__ import annotations

import functools
import os

import torch

ISA_ENV = "TOKENMILL_CPU_ISA"
CAPS = ("baseline", "avx2", "avx512", "amx")


def cap() -> str:
    """The cap TOKENMILL_CPU_ISA sets ("amx", the highest, when unset; "avx512" is AVX-512 without AMX)."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return CAPS[-1]
    if value not in CAPS:
        raise ValueError(f"{ISA_ENV}={value!r} is not one of {', '.join(CAPS)}")
    return value


@functools.cache
def bf16_gemm_native() -> bool:
    """Whether bf16 GEMMs run on bf16 dot products here (AVX512-BF16 or AMX, and the cap allows AVX-512)."""
    if cap() not in ("avx512", "amx"):
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
