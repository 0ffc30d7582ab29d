"""Q8_0's one-term products on AVX512-BF16's vector tiles (csrc/quant_bf16_vec.h), on random Q8_0 block
bytes: bf16(x) times the exact weights to fp32's rounding whatever the row count (tiles of 6 rows, a
partial last one), column blocks (pairs and an odd one), inputs (one span, several spans whose sums
add up) and threads; the rows from which `linear` takes them where the CPU has no AMX, the formats it
leaves on the VNNI kernel, and the parts of a fused linear (those of other formats each as it runs
alone). Skipped where the CPU has no AVX512-BF16."""

from __future__ import annotations

import pytest
import torch

from tests.model.conftest import one_term_rows
from tests.model.test_block_decoders import fp32_bound, one_term_bound, weight
from tokenmill.model.kernels import quant_kernel

pytestmark = pytest.mark.skipif(
    not quant_kernel.vnni_available() or not torch.ops.tokenmill_vnni.vec_capable(), reason="no AVX512-BF16 here")


def vec(x: torch.Tensor, bw) -> torch.Tensor:
    return torch.ops.tokenmill_vnni.linear_vec(x, *quant_kernel.blocked_args(bw))


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 17, 64, 100])
@pytest.mark.parametrize("n, k", [(48, 96), (32, 1536), (16, 2304)])
def test_bf16_x_times_the_exact_weights_to_fp32_rounding(rows, n, k):
    # 48 outputs: a pair of column blocks and an odd one; 1,536 inputs: one span of 48 groups; 2,304:
    # spans of 32 groups whose sums add up
    bw, ref, _ = weight("Q8_0", n, k, seed=rows + k)
    ref = torch.as_tensor(ref)
    x = torch.randn(rows, k)
    x[0, :32] = 0  # a group of zeros
    got = vec(x, bw).double()
    rounded = x.bfloat16().double() @ ref.double().T
    assert ((got - rounded).abs() <= fp32_bound(x, ref)).all()
    assert ((got - x.double() @ ref.double().T).abs() <= one_term_bound(x, ref)).all()
    assert torch.equal(vec(x.bfloat16(), bw), got.float())  # a bf16 x is its own term, read as it is


def test_the_threads_split_column_blocks_without_changing_a_bit():
    bw, _, _ = weight("Q8_0", 96, 320, seed=3)
    x = torch.randn(70, 320)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = vec(x, bw)
        torch.set_num_threads(2)
        assert torch.equal(vec(x, bw), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q6_K"])
def test_other_formats_are_refused_by_name(kind):
    bw, _, _ = weight(kind, 16, 256, seed=1)
    with pytest.raises(RuntimeError, match=f"format {bw.fmt} does not run on them"):
        vec(torch.randn(8, 256), bw)


@pytest.mark.skipif(not quant_kernel.vec_available(), reason="the AMX tiles take these steps here")
def test_linear_takes_them_from_vec_min_rows_for_q8_0_only():
    first = quant_kernel.vec_min_rows()
    assert one_term_rows("Q8_0") == first and one_term_rows("Q5_0") is None
    q8, _, _ = weight("Q8_0", 48, 256, seed=5)
    for rows in (first - 1, first, first + 9):
        x = torch.randn(rows, 256)
        got = quant_kernel.blocked_linear(x, q8)
        vnni = quant_kernel.blocked_linear(x, q8, amx=False)  # the VNNI kernel's two int8 terms
        assert torch.equal(got, vec(x, q8) if rows >= first else vnni)
        assert rows < first or not torch.equal(got, vnni)
    q5, _, _ = weight("Q5_0", 48, 256, seed=6)
    x = torch.randn(first + 9, 256)
    assert torch.equal(quant_kernel.blocked_linear(x, q5), quant_kernel.blocked_linear(x, q5, amx=False))


@pytest.mark.skipif(not quant_kernel.vec_available(), reason="the AMX tiles take these steps here")
def test_a_fused_linear_of_q8_0_parts_is_its_parts_side_by_side():
    parts = [weight("Q8_0", n, 192, seed=n)[0] for n in (64, 16, 16)]  # q, k, v
    x = torch.randn(quant_kernel.vec_min_rows() + 3, 192)
    got = quant_kernel.bound_blocked_linear_parts(parts)(x)
    assert torch.equal(got, torch.cat([vec(x, w) for w in parts], dim=1))
    mixed = parts[:2] + [weight("Q5_0", 16, 192, seed=7)[0]]  # one part the vector tiles do not take
    together = quant_kernel.bound_blocked_linear_parts(mixed)(x)  # each part as it runs alone
    assert torch.equal(together, torch.cat([vec(x, mixed[0]), vec(x, mixed[1]),
                                            quant_kernel.blocked_linear(x, mixed[2], amx=False)], dim=1))
