"""A linear whose parts a GGUF mix stores in different formats (Q4_K_M's q / k in Q4_K and v in Q6_K)
runs as one blocked-kernel call (input rounded once, each part writing its columns in place): its
output is the parts' own outputs side by side, to the bit, at decode and prompt row counts (both of
the VNNI kernel's thread splits); where a part takes another path for the rows (a dense GEMM), the
parts run one by one. Each test runs on every blocked kernel the CPU has (VNNI, AVX2)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.model.conftest import BLOCKED_KERNELS
from tests.model.test_block_decoders import random_blocks
from tokenmill.model.layers.factory import ConcatLinear
from tokenmill.model.layers.quantized_linear import QuantizedLinear
from tokenmill.model.quant import to_blocked_gguf

pytestmark = pytest.mark.skipif(not BLOCKED_KERNELS, reason="needs a blocked kernel")

K = 512
MIXES = [
    (("Q4_K", 384), ("Q6_K", 128)),
    (("Q4_0", 256), ("Q4_0", 64), ("Q5_0", 64)),
    (("Q8_0", 48), ("Q3_K", 160), ("Q5_1", 32)),
]


def parts(mix: tuple[tuple[str, int], ...], seed: int) -> list[QuantizedLinear]:
    """The mix's parts as random weights on the test's kernel."""
    return [QuantizedLinear(blocked(kind, n, seed + i), None) for i, (kind, n) in enumerate(mix)]


@functools.cache
def blocked(kind: str, n: int, seed: int):
    """A random weight, made once per module (rounding and packing them is the slow part)."""
    return to_blocked_gguf(kind, torch.from_numpy(random_blocks(kind, n, K, seed=seed, scale=1e-3)), (n, K))


@pytest.mark.parametrize("mix", MIXES, ids=["q4k+q6k", "q4_0+q5_0", "q8_0+q3k+q5_1"])
@pytest.mark.parametrize("rows", [1, 5, 16, 200])
def test_one_call_equals_the_parts_side_by_side(kernel, mix, rows):
    ps = parts(mix, seed=1)
    for p in ps:
        p._gemm_rows = 1 << 62  # every row count on the kernel, as prompt_gemm "vnni" (AVX2's auto: fp32 from 128)
    linear = ConcatLinear(ps, None)
    x = torch.randn(rows, K)
    assert linear._together is not None and all(p.runs_kernel(rows) for p in ps)
    want = torch.cat([p(x) for p in ps], dim=-1)
    got = linear(x)
    assert got.shape == (rows, sum(n for _, n in mix)) and torch.equal(got, want)
    bias = torch.randn(want.shape[1])
    assert torch.equal(ConcatLinear(ps, bias)(x), want + bias)


def test_parts_on_another_path_for_the_rows_run_one_by_one(kernel):
    ps = parts((("Q4_K", 128), ("IQ4_XS", 128)), seed=7)
    ps[1]._gemm_rows = 192  # IQ4_XS's prompt rows take a dense GEMM (bf16 on VNNI, fp32 on AVX2)
    ps[1].prompt_gemm = "bf16" if kernel == "vnni" else "fp32"
    linear = ConcatLinear(ps, None)
    rows = 256
    assert not ps[1].runs_kernel(rows) and ps[1].runs_kernel(1)
    x = torch.randn(rows, K)
    assert torch.equal(linear(x), torch.cat([p(x).float() for p in ps], dim=-1))
    assert torch.equal(linear(x[:3]), torch.cat([p(x[:3]) for p in ps], dim=-1))  # few rows: one call again
