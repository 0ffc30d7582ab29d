"""The quantized-linear kernel (csrc/quant_linear.cpp) against the dequantized reference, every ISA
variant, every row-count path; the packed format against gguf's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokenmill.model.kernels import quant_kernel
from tokenmill.model.layers.quantized_linear import QuantizedLinear
from tokenmill.model.quant import QuantizedWeight, from_gguf_blocks, quantize_int4, quantize_int8, to_blocked

pytestmark = pytest.mark.skipif(not quant_kernel.available(), reason="the C++ kernel could not be built here")


def gguf_weight(kind: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    blocks = quantize(w, GGMLQuantizationType[kind])
    return from_gguf_blocks(kind, blocks, (n, k)), dequantize(blocks, GGMLQuantizationType[kind]).reshape(n, k)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_dequantize_bit_for_bit(kind):
    qw, ref = gguf_weight(kind, 48, 96)
    assert qw.shape == (48, 96) and qw.bits == (8 if kind == "Q8_0" else 4)
    assert torch.equal(qw.dequantize(), torch.from_numpy(ref))  # the exact path sees gguf's numbers
    assert torch.equal(quant_kernel.dequantize(qw, torch.float32), torch.from_numpy(ref))
    assert torch.equal(quant_kernel.dequantize(qw, torch.bfloat16), torch.from_numpy(ref).bfloat16())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17])
@pytest.mark.parametrize("isa", [0, 1, 2])
def test_kernel_matches_dequantized_matmul(kind, rows, isa):
    # 37 output columns: tiles of 8 and 4 plus a ragged tail; K = 160 = 5 groups (the min term's mask).
    qw, ref = gguf_weight(kind, 37, 160, seed=rows)
    x = torch.randn(rows, 160)
    expected = x.double() @ torch.from_numpy(ref).double().T
    got = quant_kernel.linear(x, qw, isa)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("quantizer, tolerance", [(quantize_int8, 0.01), (quantize_int4, 0.15)])
def test_quantize_at_load_round_trips(quantizer, tolerance):
    w = torch.randn(64, 128) * 0.1
    qw = quantizer(w)
    assert qw.shape == (64, 128)
    err = (qw.dequantize() - w).abs().max().item()
    assert 0 < err < tolerance * w.abs().max().item()
    # Memory: 8 or 4 bits per weight plus 2 fp16 per group of 32 for scale (and min).
    per_weight = qw.nbytes / w.numel()
    assert per_weight == pytest.approx(1 + 2 / 32 if qw.bits == 8 else 0.5 + 4 / 32)


def test_layer_switches_to_bf16_gemm_for_many_rows():
    qw, ref = gguf_weight("Q4_1", 64, 128)
    bias = torch.randn(64)
    layer = QuantizedLinear(qw, bias, dense_min_rows=8)
    for rows in (1, 7, 8, 40, 200):  # 200: past BLOCKED_DENSE_MIN_ROWS too
        x = torch.randn(rows, 128)
        expected = x @ torch.from_numpy(ref).T + bias
        # Below the threshold fp32 activations (int8 ones on AVX512-VNNI), above it bf16 ones: each
        # within its rounding of the exact product.
        atol = 1e-5 if rows < 8 and not quant_kernel.vnni_available() else 3e-2
        torch.testing.assert_close(layer(x), expected, atol=atol, rtol=1e-2)


def test_stacked_weights_equal_separate_ones():
    a, _ = gguf_weight("Q4_1", 32, 64, seed=1)
    b, _ = gguf_weight("Q4_1", 16, 64, seed=2)
    both = QuantizedWeight.cat([a, b])
    x = torch.randn(3, 64)
    torch.testing.assert_close(quant_kernel.linear(x, both),
                               torch.cat([quant_kernel.linear(x, a), quant_kernel.linear(x, b)], dim=1))
    with pytest.raises(ValueError, match="different formats"):
        QuantizedWeight.cat([a, gguf_weight("Q8_0", 16, 64)[0]])


def test_bad_shapes_are_errors_not_wild_reads():
    qw, _ = gguf_weight("Q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="codes must be"):
        quant_kernel.linear(torch.randn(2, 96), qw)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int8(torch.randn(4, 40))


def int8_activation_reference(x: torch.Tensor, qw: QuantizedWeight, terms: int = 1) -> torch.Tensor:
    """What the VNNI path computes: activations rounded to int8 per group of 32 (scale amax / 127),
    with terms=2 the rounding residual rounded again on steps of 1/256 of the first scale (saturated
    to int8); integer dot products with the codes, then the weight and activation scales, plus the
    min term over the same rounded activations."""
    n, k = qw.shape
    rest = x.view(x.shape[0], k // 32, 32)
    codes = qw._codes_by_group().double()  # [N, G, 32] (int8 codes are signed)
    out = torch.zeros(x.shape[0], n, dtype=torch.float64)
    qsum = torch.zeros(x.shape[0], k // 32, dtype=torch.float64)
    amax = rest.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros(()))
    scale = amax / 127
    for t in range(terms):
        if t > 0:  # powers of two: exact, as in the kernel
            inv, scale = inv * 256, scale / 256
        xq = torch.round(rest * inv).clamp(-128, 127)
        dots = torch.einsum("mgj,ngj->mng", xq.double(), codes)
        out += (dots * qw.scales.double().unsqueeze(0) * scale.double().transpose(1, 2)).sum(-1)
        qsum += xq.sum(-1).double() * scale.squeeze(-1).double()
        rest = (rest.double() - xq.double() * scale.double()).float()  # the kernel's fused multiply-add
    if qw.mins is not None:
        out += qsum @ qw.mins.double().T
    return out


@pytest.mark.skipif(not quant_kernel.vnni_available(), reason="no AVX512-VNNI here")
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_blocked_vnni_kernel_matches_int8_activation_reference(kind, rows):
    qw, ref = gguf_weight(kind, 48, 160, seed=rows)  # 3 column blocks, 5 groups
    blocked = to_blocked(qw)
    assert blocked.nbytes == qw.nbytes  # a re-layout, not a copy with extras
    x = torch.randn(rows, 160)
    one_term = quant_kernel.blocked_linear(x, blocked, terms=1)
    torch.testing.assert_close(one_term.double(), int8_activation_reference(x, qw), atol=1e-4, rtol=1e-4)
    # Two int8 terms per activation (the default): ~15 bits, within ~1e-4 of the exact product.
    exact = x.double() @ torch.from_numpy(ref).double().T
    two_terms = quant_kernel.blocked_linear(x, blocked)
    assert (two_terms.double() - exact).abs().max() < 1e-3 * exact.abs().max()
    assert (two_terms.double() - exact).abs().max() < 0.1 * (one_term.double() - exact).abs().max()
    ids = torch.tensor([0, 47, 16, 5, 16])
    assert torch.equal(quant_kernel.blocked_rows(blocked, ids), qw.rows(ids).dequantize())
    assert torch.equal(quant_kernel.blocked_dequantize_bf16(blocked), qw.dequantize().bfloat16())
    with pytest.raises(ValueError, match="multiple of 16"):
        to_blocked(gguf_weight(kind, 40, 64)[0])


@pytest.mark.skipif(not quant_kernel.vnni_available(), reason="no AVX512-VNNI here")
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [*range(1, 18), 24, 31, 33, 48, 64])
@pytest.mark.parametrize("k", [96, 160, 256])
def test_blocked_vnni_kernel_every_row_tiling(kind, rows, k):
    # Rows run in tiles of up to 8 (9 = 5 + 4, 17 = 6 + 6 + 5, ...) and activations are rounded four
    # groups at a time: K = 96 (3 groups) takes only the one-group path, 160 both, 256 only the other.
    qw, _ = gguf_weight(kind, 48, k, seed=rows)
    blocked = to_blocked(qw)
    x = torch.randn(rows, k)
    x[0, :32] = 0  # a group of zeros: scale 0, not a division by zero
    for terms in (1, 2):
        expected = int8_activation_reference(x, qw, terms)
        got = quant_kernel.blocked_linear(x, blocked, terms=terms, amx=False)
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not quant_kernel.vnni_available(), reason="no AVX512-VNNI here")
@pytest.mark.parametrize("rows", [1, 5, 33, 64, 400])
def test_blocked_vnni_kernel_split_across_threads(rows):
    # Enough columns for the threads to split the blocks, from 16 rows the rows (each thread rounds
    # its own), 400 rows a scratch buffer too large to keep: the result must not depend on the number
    # of threads. (The VNNI kernel's arithmetic: amx=False; tests/model/test_quant_amx.py has the tiles.)
    qw, _ = gguf_weight("Q4_0", 512, 1024, seed=rows)
    blocked = to_blocked(qw)
    x = torch.randn(rows, 1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_kernel.blocked_linear(x, blocked, amx=False)
        torch.set_num_threads(2)
        two = quant_kernel.blocked_linear(x, blocked, amx=False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(two.double(), int8_activation_reference(x, qw, terms=2), atol=1e-4, rtol=1e-4)
