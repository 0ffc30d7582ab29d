"""Every kernel test draws its inputs from a seeded generator: a tolerance that fails, fails again.
`kernel`: a test that takes it runs once per column-blocked kernel this CPU can run (AVX512-VNNI, and
AVX2, which every AVX-512 CPU runs too), every quant_kernel call of it going to that kernel."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.kernels import quant_kernel

# The formats whose AMX-BF16 tiles (steps of amx_min_rows()+ rows, where the CPU has them) multiply
# bf16(x) alone (quant_amx.h `kTerms`): each activation rounded once, |x - bf16(x)| <= 2^-9 |x|.
AMX_ONE_TERM = frozenset({"Q8_0", "Q6_K"})


def one_term_rows(kind: str) -> int | None:
    """From how many rows `blocked_linear` multiplies a weight of GGUF type `kind` by bf16(x) alone (one
    activation term: the AMX tiles' Q8_0 and Q6_K, the vector tiles' Q8_0 without AMX), or None where
    it never does."""
    if quant_kernel.blocked_kernel() != "vnni":
        return None
    if quant_kernel.amx_available() and kind in AMX_ONE_TERM:
        return quant_kernel.amx_min_rows()
    if quant_kernel.vec_available() and kind == "Q8_0":
        return quant_kernel.vec_min_rows()
    return None


def one_term_slack(*kinds: str) -> float:
    """The factor on a tolerance between two paths of a fast model whose weights include these kinds
    ("int8": a dense checkpoint quantized at load into Q8_0's blocks): 3 where one-term products run
    (the AMX tiles; Q8_0's vector tiles on AVX512-BF16 without AMX), since a last-bit difference
    upstream then moves an activation by a bf16 step (2^-8 of it) instead of ~2^-16 (measured:
    1.3-1.9x the two terms' tolerances on the tiny models), else 1."""
    kinds = tuple("Q8_0" if kind == "int8" else kind for kind in kinds)
    return 3.0 if any(one_term_rows(kind) is not None for kind in kinds) else 1.0


BLOCKED_KERNELS = [name for name, ok in (("vnni", quant_kernel.vnni_available()),
                                         ("avx2", quant_kernel.avx2_blocked_available())) if ok]


@pytest.fixture(params=BLOCKED_KERNELS)
def kernel(request, monkeypatch) -> str:
    monkeypatch.setattr(quant_kernel, "blocked_kernel", lambda: request.param)
    return request.param


@pytest.fixture(autouse=True)
def seeded_torch():
    torch.manual_seed(0)
