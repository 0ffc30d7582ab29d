"""Every kernel test draws its inputs from a seeded generator: a tolerance that fails, fails again.
`kernel`: a test that takes it runs once per column-blocked kernel this CPU can run (AVX512-VNNI, and
AVX2, which every AVX-512 CPU runs too), every quant_kernel call of it going to that kernel."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.kernels import quant_kernel

BLOCKED_KERNELS = [name for name, ok in (("vnni", quant_kernel.vnni_available()),
                                         ("avx2", quant_kernel.avx2_blocked_available())) if ok]


@pytest.fixture(params=BLOCKED_KERNELS)
def kernel(request, monkeypatch) -> str:
    monkeypatch.setattr(quant_kernel, "blocked_kernel", lambda: request.param)
    return request.param


@pytest.fixture(autouse=True)
def seeded_torch():
    torch.manual_seed(0)
