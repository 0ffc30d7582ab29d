"""Every GGUF block format the blocked kernels read (model/blocked_formats.py, csrc/quant_blocks.h), on
random block bytes: the re-layout loses nothing (gguf-py's dequantization, bit for bit), and each
kernel shape matches a float64 product within the bound its activation rounding allows. The kernel
tests run once per blocked kernel this CPU can run: AVX512-VNNI (csrc/quant_vnni.h) and AVX2
(csrc/quant_avx2.h), through conftest.py's `kernel` fixture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.conftest import BLOCKED_KERNELS, one_term_rows
from tokenmill.model import blocked_formats
from tokenmill.model.kernels import cpu_isa, quant_kernel
from tokenmill.model.layers.quantized_linear import (
    AVX2_DENSE_MIN_ROWS,
    BLOCKED_DENSE_MIN_ROWS,
    QuantizedEmbedding,
    QuantizedLinear,
)
from tokenmill.model.quant import KERNEL_TYPES, BlockedWeight, to_blocked_gguf
from tokenmill.model.quant_formats import dequantize_rows, format_of

pytestmark = pytest.mark.skipif(not BLOCKED_KERNELS, reason="no blocked kernel here")

# Byte offsets of each block's fp16 fields (d, dmin / m): any other byte pattern is a valid block.
FP16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
    "Q1_0": (0,), "Q2_0": (0,), "MXFP4": (),
}
# MXFP4's scale is an E8M0 exponent byte (the block's first): 2^(e - 128), kept near 2^-8 here; the
# lossless test also takes 0 and 1 (ggml's subnormal halves) and the largest finite ones.
E8M0_BYTE = {"MXFP4": 0}
TYPES = sorted(KERNEL_TYPES)
SUPER = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}


def width(kind: str, legacy: int, super_block: int) -> int:
    """A test's K: `super_block` for 256-wide formats, else `legacy` (32-wide blocks), rounded up to
    whole blocks for Q2_0 / Q1_0 (64 / 128 inputs a block)."""
    if kind in SUPER:
        return super_block
    block = format_of(kind).block_elems
    return -(-legacy // block) * block


def random_blocks(kind: str, n: int, k: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """uint8 [n, row bytes] of random blocks whose fp16 scales are finite (~scale, either sign)."""
    block, size = format_of(kind).block_elems, format_of(kind).block_bytes
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        raw[..., at : at + 2] = (rng.standard_normal((n, k // block, 1)) * scale).astype(np.float16).view(np.uint8)
    if kind in E8M0_BYTE:  # 2^(e - 128) * codes up to 12: ~scale
        raw[..., E8M0_BYTE[kind]] = rng.integers(117, 122, size=(n, k // block), dtype=np.uint8)
    return raw.reshape(n, -1)


def weight(kind: str, n: int, k: int, seed: int = 0) -> tuple[BlockedWeight, torch.Tensor, int]:
    raw = random_blocks(kind, n, k, seed)
    ref = dequantize_rows(kind, raw, k)  # gguf-py's values (ggml's for the types it lacks), tested bit for bit
    return to_blocked_gguf(kind, torch.from_numpy(raw), (n, k)), ref, raw.nbytes


def two_term_bound(x: torch.Tensor, w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """|kernel - x @ w.T| bound [M, N]. Each activation is rounded to int8 twice per group of 32
    (quant_acts.h; `group` 256 for the AMX-INT8 tiles, test_quant_amx8.py): term 1 leaves |r| <= d1 / 2 (+ fp32 rounding) with d1 = amax / 127, term 2
    rounds r on steps of d2 = d1 / 256 and leaves <= d2 / 2, or up to d2 where r / d2 rounds to
    128 and saturates to 127, so |x - x'| <= 1.01 amax / (127 * 256) for every element of the
    group; products with the codes are exact integers. Plus fp32 rounding of the per-group scaling
    (the merged sum 256 D1 + D2 converted to fp32, one more rounding) and accumulation: (G + 10)
    units of 2^-24 of sum |w x| (x4 for the min terms, which are of the size of the weights here)."""
    m, k = x.shape
    g = k // group
    amax = x.double().abs().reshape(m, g, group).amax(-1)  # [M, G]
    wabs = w.double().abs().reshape(w.shape[0], g, group).sum(-1)  # [N, G]
    rounding = amax @ wabs.T / (127 * 256) * 1.01
    return rounding + fp32_bound(x, w)


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 rounding's share of a kernel's bound [M, N]: each group's sum, its scaling (a multiply-add
    by the scale, one by the min times the row's sum of x) and the accumulation over G groups of 32,
    (G + 10) units of 2^-24 of sum |w x| (x4 for the min terms, which are of the size of the weights
    here)."""
    return (x.shape[1] // 32 + 10) * 2.0**-24 * 4 * (x.double().abs() @ w.double().abs().T) + 1e-30


def one_term_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|tiles - x @ w.T| bound [M, N] of the one-term formats' AMX tiles (the codes exact in bf16, the
    tiles' products exact in fp32, then fp32_bound)."""
    return 2.0**-9 * 1.01 * (x.double().abs() @ w.double().abs().T) + fp32_bound(x, w)


def kernel_bound(x: torch.Tensor, w: torch.Tensor, kind: str, kernel: str) -> torch.Tensor:
    """The bound of `blocked_linear(x)` on `kernel`: the two int8 terms', or one_term_bound where
    one-term products take the rows (conftest.one_term_rows: the AMX tiles' Q8_0 and Q6_K, the
    vector tiles' Q8_0; the AMX tiles' two bf16 terms are within two_term_bound)."""
    rows = one_term_rows(kind) if kernel == "vnni" else None
    return one_term_bound(x, w) if rows is not None and x.shape[0] >= rows else two_term_bound(x, w)


@pytest.mark.parametrize("kind", TYPES)
def test_relayout_is_lossless(kernel, kind):
    k = width(kind, 160, 512)
    bw, ref, file_bytes = weight(kind, 48, k)
    if kind in E8M0_BYTE:  # every exponent byte with finite values: subnormal halves (0, 1) to 2^125
        raw = random_blocks(kind, 48, k)
        e = np.arange(48 * k // 32) * 13 % 253  # up to 252: 12 x 2^124, the largest finite
        e[:3] = (0, 1, 252)
        raw.reshape(48, k // 32, -1)[..., E8M0_BYTE[kind]] = e.reshape(48, -1)
        bw, ref, file_bytes = to_blocked_gguf(kind, torch.from_numpy(raw), (48, k)), dequantize_rows(kind, raw, k), raw.nbytes
        assert torch.isfinite(ref).all()
    assert bw.kind == kind and bw.shape == (48, k)
    ids = torch.arange(48)
    assert torch.equal(quant_kernel.blocked_rows(bw, ids), ref)  # gguf-py's fp32 values, bit for bit
    assert torch.equal(quant_kernel.blocked_dequantize_bf16(bw), ref.bfloat16())
    # The same values written into the thread's reused weight scratch (prompt GEMMs), in both dtypes.
    assert torch.equal(quant_kernel.blocked_dense_scratch(bw, torch.bfloat16), ref.bfloat16())
    assert torch.equal(quant_kernel.blocked_dense_scratch(bw, torch.float32), ref)
    # Memory stays the file's: 6-bit sub-block scales become bytes (Q3_K +4/110, Q4_K +4/144), nothing
    # else grows, except Q4_0, which keeps today's numbers: its -8 d as an fp16 min (+2/18).
    assert file_bytes <= bw.nbytes <= (1.12 if kind == "Q4_0" else 1.04) * file_bytes


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "Q2_0"])
def test_a_weight_converted_in_chunks_by_threads_is_the_weight_converted_whole(kind, monkeypatch):
    # Q8_0 goes through the row layout first (quant.to_blocked_gguf), the others blocked_from_file;
    # 16 rows a chunk: 7 chunks, all but the first converted side by side and placed by row.
    k = width(kind, 160, 512)
    raw = torch.from_numpy(random_blocks(kind, 112, k, seed=3))
    whole = to_blocked_gguf(kind, raw, (112, k))
    monkeypatch.setattr(blocked_formats, "CHUNK_WEIGHTS", 16 * k)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        chunked = to_blocked_gguf(kind, raw, (112, k))
    finally:
        torch.set_num_threads(threads)
    for a, b in ((whole.codes, chunked.codes), (whole.scales, chunked.scales), (whole.mins, chunked.mins),
                 (whole.subs, chunked.subs)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17, 48, BLOCKED_DENSE_MIN_ROWS + 8])
def test_kernel_within_activation_rounding(kernel, kind, rows):
    # 1-2 rows: matrix-vector tiles with two chains; 3..8 one tile; 9, 17: uneven tiles; from 16 the
    # threads split rows; a prompt's rows run this kernel too with prompt_gemm "vnni" (every format's
    # choice then; "auto" picks it for codes wider than 4 bits).
    # K = 768 for super-blocks (3 of them), 160 (a ragged group) otherwise.
    k = width(kind, 160, 768)
    bw, ref, _ = weight(kind, 64, k, seed=rows)
    x = torch.randn(rows, k)
    x[0, 32:64] = 0  # a group of zeros: scale 0, not a division by zero
    exact = x.double() @ ref.double().T
    got = quant_kernel.blocked_linear(x, bw).double()
    assert ((got - exact).abs() <= kernel_bound(x, ref, kind, kernel)).all()
    layer = QuantizedLinear(bw, None, prompt_gemm="vnni")
    assert torch.equal(layer(x), quant_kernel.blocked_linear(x, bw))


@pytest.mark.parametrize("kind", TYPES)
def test_a_rows_result_does_not_depend_on_its_tile(kernel, kind):
    # A row's sums are exact integers and its fp32 scaling the same operations in the same order in
    # every tile shape (1-2 rows: both halves at once in two chains; from 3 rows: one chain, or for
    # Q2_K / Q3_K / Q6_K the group's two halves in turn, csrc/quant_vnni.h half_tile): so each row of
    # 11 (tiles of 6 + 5) and of 24 (threads split rows) equals that row alone, bit for bit.
    k = width(kind, 160, 768)
    bw, _, _ = weight(kind, 48, k, seed=7)
    for rows in (11, 24):
        x = torch.randn(rows, k)
        got = quant_kernel.blocked_linear(x, bw, amx=False)  # the vector kernel (24 rows may take AMX-INT8 tiles)
        alone = torch.cat([quant_kernel.blocked_linear(x[i : i + 1], bw, amx=False) for i in range(rows)])
        assert torch.equal(got, alone)


# What "auto" chooses per format where the CPU has VNNI and a native bf16 GEMM (this one, so far).
vnni_bf16 = pytest.mark.skipif(not (quant_kernel.vnni_available() and cpu_isa.bf16_gemm_native()),
                               reason="the per-format prompt paths are those of VNNI CPUs with native bf16")


@vnni_bf16
@pytest.mark.parametrize("kind", TYPES)
def test_prompt_rows_can_run_bf16_gemm_on_the_file_values(kind):
    k = width(kind, 160, 512)
    bw, ref, _ = weight(kind, 32, k, seed=3)
    rows = BLOCKED_DENSE_MIN_ROWS + 8
    x = torch.randn(rows, k)
    got = QuantizedLinear(bw, None, prompt_gemm="bf16")(x).double()
    # bf16 activations and weights (each rounded once), fp32 accumulation over K (at most K units of
    # 2^-24 of sum |w x|), the output rounded to bf16 (8 significant bits: 2^-8 of it).
    xb, wb = x.bfloat16().double(), ref.bfloat16().double()
    exact = xb @ wb.T
    bound = exact.abs() * 2.0**-8 + k * 2.0**-24 * (xb.abs() @ wb.abs().T)
    assert ((got - exact).abs() <= bound * (1 + 2.0**-8)).all()


# What "auto" runs a prompt step of each format on: the 4-bit formats whose mixes kept 99% top-1 on
# the bf16 GEMM (quant_formats/registry.py), every other one on the kernel.
AUTO_PROMPT_GEMM = {
    "Q2_K": "vnni", "Q3_K": "vnni", "Q4_0": "vnni", "Q4_1": "bf16", "Q4_K": "vnni", "IQ4_NL": "bf16",
    "IQ4_XS": "bf16", "Q5_0": "vnni", "Q5_1": "vnni", "Q5_K": "vnni", "Q6_K": "vnni", "Q8_0": "vnni",
    "Q2_0": "vnni", "Q1_0": "vnni", "MXFP4": "vnni",
}


@vnni_bf16
@pytest.mark.parametrize("kind", TYPES)
def test_prompt_rows_take_their_formats_path_unless_one_is_asked_for(kind):
    k = width(kind, 64, 256)
    bw, _, _ = weight(kind, 32, k, seed=4)
    x = torch.randn(BLOCKED_DENSE_MIN_ROWS, k)
    kernel = quant_kernel.blocked_linear(x, bw)
    auto = QuantizedLinear(bw, None)
    bf16 = AUTO_PROMPT_GEMM[kind] == "bf16"
    assert auto.bf16_from_rows == (BLOCKED_DENSE_MIN_ROWS if bf16 else None)
    assert torch.equal(auto(x), QuantizedLinear(bw, None, prompt_gemm="bf16")(x)) == bf16
    assert torch.equal(auto(x), kernel) != bf16
    # one row less is a decode step: the kernel whatever the prompt path
    assert torch.equal(auto(x[1:]), quant_kernel.blocked_linear(x[1:], bw))
    for setting in ("vnni", "bf16"):
        assert QuantizedLinear(bw, None, prompt_gemm=setting).bf16_from_rows == (
            BLOCKED_DENSE_MIN_ROWS if setting == "bf16" else None)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_one_term_within_its_rounding(kernel, kind, rows):
    # llama.cpp's Q8 activations (terms = 1): each value rounded once, within d1 / 2 = amax / 254.
    k = width(kind, 160, 512)
    bw, ref, _ = weight(kind, 32, k, seed=rows + 20)
    x = torch.randn(rows, k)
    exact = x.double() @ ref.double().T
    got = quant_kernel.blocked_linear(x, bw, terms=1).double()
    g = k // 32
    amax = x.double().abs().reshape(rows, g, 32).amax(-1)
    wabs = ref.double().abs().reshape(ref.shape[0], g, 32).sum(-1)
    bound = amax @ wabs.T / 254 * 1.01 + (g + 10) * 2.0**-24 * 4 * (x.double().abs() @ ref.double().abs().T)
    assert ((got - exact).abs() <= bound).all()


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "Q5_0"])
def test_prompt_rows_on_an_fp32_gemm_take_the_file_values(kernel, kind):
    k = width(kind, 160, 512)
    bw, ref, _ = weight(kind, 32, k, seed=6)
    layer = QuantizedLinear(bw, None, prompt_gemm="fp32")
    assert layer.bf16_from_rows is None and not layer.kernel_at_any_rows
    x = torch.randn(AVX2_DENSE_MIN_ROWS, k)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, ref))  # the file's values, fp32 throughout
    assert torch.equal(layer(x[1:]), quant_kernel.blocked_linear(x[1:], bw))  # fewer rows: the kernel


def test_auto_prompt_path_where_bf16_is_not_native(kernel, monkeypatch):
    # oneDNN emulates bf16 at a fifth of fp32's speed there: VNNI CPUs (Ice Lake, Cascade Lake) run
    # their kernel at every row count, AVX2 ones an fp32 GEMM from AVX2_DENSE_MIN_ROWS, any format.
    monkeypatch.setattr(cpu_isa, "bf16_gemm_native", lambda: False)
    for kind in ("Q4_1", "IQ4_XS", "Q6_K", "Q8_0", "MXFP4", "Q1_0"):
        bw, _, _ = weight(kind, 32, width(kind, 64, 256), seed=8)
        layer = QuantizedLinear(bw, None)
        assert layer.prompt_gemm == ("vnni" if kernel == "vnni" else "fp32")
        assert layer.kernel_at_any_rows == (kernel == "vnni") and layer.bf16_from_rows is None


def test_unknown_prompt_gemm_is_named():
    bw, _, _ = weight("Q4_0", 32, 64, seed=0)
    with pytest.raises(ValueError, match="prompt_gemm must be one of"):
        QuantizedLinear(bw, None, prompt_gemm="fp8")


@pytest.mark.parametrize("kind", TYPES)
def test_embedding_rows(kernel, kind):
    k = width(kind, 96, 256)
    bw, ref, _ = weight(kind, 32, k, seed=5)
    ids = torch.tensor([0, 31, 16, 5, 16, 17])
    assert torch.equal(QuantizedEmbedding(bw)(ids), ref[ids])


def test_stacked_blocked_weights_equal_separate_ones(kernel):
    a, ra, _ = weight("Q4_K", 32, 256, seed=1)
    b, rb, _ = weight("Q4_K", 16, 256, seed=2)
    both = BlockedWeight.cat([a, b])
    assert both.shape == (48, 256)
    assert torch.equal(quant_kernel.blocked_rows(both, torch.arange(48)), torch.cat([ra, rb]))
    with pytest.raises(ValueError, match="different formats"):
        BlockedWeight.cat([a, weight("Q6_K", 16, 256)[0]])


@pytest.mark.parametrize("kind, shape, message", [
    ("Q4_K", (40, 256), "N % 16"), ("Q6_K", (32, 320), "K % 256"), ("Q5_0", (32, 48), "K % 32"),
    ("Q4_1", (40, 64), "multiple of 16"),
])
def test_shapes_that_do_not_fit_are_named(kind, shape, message):
    n, k = shape
    block, size = format_of(kind).block_elems, format_of(kind).block_bytes
    raw = torch.zeros(n, max(1, k // block) * size, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        to_blocked_gguf(kind, raw, shape)


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
def test_conversion_in_row_chunks_is_the_same_weight(kind, monkeypatch):
    from tokenmill.model import blocked_formats

    raw = torch.from_numpy(random_blocks(kind, 80, 256, seed=7))
    whole = to_blocked_gguf(kind, raw, (80, 256))
    monkeypatch.setattr(blocked_formats, "CHUNK_WEIGHTS", 32 * 256)  # chunks of 32 rows: 32 + 32 + 16
    chunked = to_blocked_gguf(kind, raw, (80, 256))
    for a, b in ((whole.codes, chunked.codes), (whole.scales, chunked.scales), (whole.mins, chunked.mins),
                 (whole.subs, chunked.subs)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q2_0", "Q1_0"])
def test_shards_hold_the_file_values(kernel, kind):
    k = width(kind, 192, 768)
    bw, ref, _ = weight(kind, 64, k, seed=9)
    rows = bw.row_slice(16, 48)
    assert torch.equal(quant_kernel.blocked_rows(rows, torch.arange(32)), ref[16:48])
    cut = 256 if kind in SUPER else max(64, format_of(kind).block_elems)
    cols = bw.column_slice(cut, k)
    assert cols.shape == (64, k - cut)
    assert torch.equal(quant_kernel.blocked_rows(cols, torch.arange(64)), ref[:, cut:])
    x = torch.randn(3, k - cut)
    got = quant_kernel.blocked_linear(x, cols).double()
    assert ((got - x.double() @ ref[:, cut:].double().T).abs() <= two_term_bound(x, ref[:, cut:])).all()
    with pytest.raises(ValueError, match="split its blocks" if kind in SUPER else "would split"):
        bw.column_slice(32 if kind in SUPER else 16, k)
    with pytest.raises(ValueError, match="blocks of 16"):
        bw.row_slice(8, 48)
