"""The AMX-INT8 tiles for steps of a few dozen rows (csrc/quant_amx8.h), on random block bytes of the
super-block formats whose sub-block scales fold into two int8 planes: within the rounding of two int8
activation terms per 256 inputs of a float64 product, whatever the rows (tiles of 16 with padding),
super-blocks, threads and an outlier input; the rows and formats from which `linear` takes them; the
parts of a fused linear that fold; and the errors that name what the tiles do not take. Skipped where the CPU
(or TOKENMILL_CPU_ISA) has no AMX-INT8."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_block_decoders import two_term_bound, weight
from tests.model.test_quant_amx import assert_rows_alone_and_threads_alike
from tokenmill.model.kernels import quant_kernel

pytestmark = pytest.mark.skipif(not quant_kernel.amx8_available(), reason="no AMX-INT8 here")

FOLDING = ["Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]


def amx8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The VNNI kernel's two-term bound (test_block_decoders.two_term_bound) with each activation
    rounded on the amax of its 256 inputs instead of its 32: the planes' products are exact integers,
    and a super-block's sums are scaled once."""
    return two_term_bound(x, w, group=256)


@pytest.mark.parametrize("kind", FOLDING)
@pytest.mark.parametrize("rows", [1, 12, 16, 17, 47, 64])
def test_tiles_within_two_int8_terms_per_super_block_of_the_exact_product(kind, rows):
    bw, ref, _ = weight(kind, 48, 512, seed=rows)
    x = torch.randn(rows, 512)
    x[0, :256] = 0  # a super-block of zeros
    x[-1, 300] = 40.0  # an outlier: its super-block's other values round on its amax
    ref = torch.as_tensor(ref)
    got = quant_kernel.blocked_linear_amx8(x, bw).double()
    assert ((got - x.double() @ ref.double().T).abs() <= amx8_bound(x, ref)).all()


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("super_blocks", [1, 3, 6])
def test_odd_counts_of_super_blocks_and_column_blocks(kind, super_blocks):
    k = 256 * super_blocks
    bw, ref, _ = weight(kind, 80, k, seed=super_blocks)  # 5 column blocks
    ref = torch.as_tensor(ref)
    x = torch.randn(20, k)
    got = quant_kernel.blocked_linear_amx8(x, bw).double()
    assert ((got - x.double() @ ref.double().T).abs() <= amx8_bound(x, ref)).all()


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_a_rows_result_does_not_depend_on_the_other_rows_or_threads(kind):
    bw, _, _ = weight(kind, 256, 512)
    # first / last of a tile, a tile's first, the padded tile's last row
    assert_rows_alone_and_threads_alike(lambda x: quant_kernel.blocked_linear_amx8(x, bw), torch.randn(40, 512), (0, 15, 16, 39))


def test_linear_takes_the_tiles_from_twelve_rows_of_a_folding_format():
    bw, _, _ = weight("Q6_K", 64, 256)
    amx_from = int(torch.ops.tokenmill_vnni.amx_min_rows())
    for rows in (12, 16, amx_from - 1):
        x = torch.randn(rows, 256)
        assert torch.equal(quant_kernel.blocked_linear(x, bw), quant_kernel.blocked_linear_amx8(x, bw))
    x = torch.randn(11, 256)  # fewer rows: the VNNI kernel
    assert torch.equal(quant_kernel.blocked_linear(x, bw), quant_kernel.blocked_linear(x, bw, amx=False))
    assert not torch.equal(quant_kernel.blocked_linear_amx8(x, bw), quant_kernel.blocked_linear(x, bw, amx=False))
    x = torch.randn(amx_from, 256)  # from kAmxMinRows on: the AMX-BF16 tiles
    assert torch.equal(quant_kernel.blocked_linear(x, bw), quant_kernel.blocked_linear_amx(x, bw))
    x = torch.randn(16, 256)  # one int8 term, or a format that does not fold: the VNNI kernel
    assert torch.equal(quant_kernel.blocked_linear(x, bw, terms=1), quant_kernel.blocked_linear(x, bw, terms=1, amx=False))
    q8, _, _ = weight("Q8_0", 64, 256)
    assert torch.equal(quant_kernel.blocked_linear(x, q8), quant_kernel.blocked_linear(x, q8, amx=False))


def test_the_parts_of_a_fused_linear_that_fold_take_the_tiles():
    parts = [weight(kind, n, 256, seed=i)[0] for i, (kind, n) in enumerate([("Q4_K", 64), ("Q8_0", 32), ("IQ4_XS", 16)])]
    x = torch.randn(16, 256)
    fused = quant_kernel.bound_blocked_linear_parts(parts)(x)
    # Q8_0's scale per 32 inputs does not fold: its part stays on the VNNI kernel, as in a fused step
    expected = [quant_kernel.blocked_linear_amx8(x, parts[0]), quant_kernel.blocked_linear(x, parts[1], amx=False),
                quant_kernel.blocked_linear_amx8(x, parts[2])]
    assert torch.equal(fused, torch.cat(expected, dim=1))


def test_what_the_tiles_do_not_take_is_named():
    x = torch.randn(16, 256)
    with pytest.raises(RuntimeError, match="does not fold"):
        quant_kernel.blocked_linear_amx8(x, weight("Q8_0", 16, 256)[0])
    with pytest.raises(RuntimeError, match="AMX-INT8 tiles: unsupported shape"):
        quant_kernel.blocked_linear_amx8(torch.randn(65, 256), weight("Q6_K", 16, 256)[0])
