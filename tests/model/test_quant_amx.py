"""The AMX-BF16 tiles for steps of many rows (csrc/quant_amx.h), on random block bytes of every GGUF
format the blocked kernels read: within the rounding of two bf16 activation terms of a float64
product (one term for Q8_0 and Q6_K), whatever the row count (tiles of 16 with padding, in pairs), column blocks (odd counts), unit
count (odd, halves of sub-blocks) and threads; the rows from which `linear` takes them; the parts of a
fused linear; and the cap that turns them off. Skipped where the CPU (or TOKENMILL_CPU_ISA) has no AMX."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.model.conftest import AMX_ONE_TERM
from tests.model.test_block_decoders import TYPES, fp32_bound, one_term_bound, weight, width
from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model.kernels import quant_kernel

pytestmark = pytest.mark.skipif(not quant_kernel.amx_available(), reason="no AMX-BF16 here")


def amx_bound(x: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """|tiles - x @ w.T| bound [M, N]. x = hi + lo + r with hi = bf16(x), lo = bf16(x - hi): |r| <=
    2^-16 |x| (lo keeps 8 bits of a residual <= 2^-8 |x|); the codes minus their offset are exact in
    bf16 and the tile's products exact in fp32; then fp32 rounding (fp32_bound). The one-term
    formats: one_term_bound."""
    if kind in AMX_ONE_TERM:
        return one_term_bound(x, w)
    return 2.0**-16 * 1.01 * (x.double().abs() @ w.double().abs().T) + fp32_bound(x, w)


def two_planes(w: torch.Tensor) -> torch.Tensor:
    """w as the tiles take Q6_K's weights, all of its scale multiplied in (quant_amx_weights.h
    kFoldsScale): hi = bf16(w), plus bf16 of what hi left (exact in fp32); within 2^-16 of w."""
    hi = w.bfloat16().float()
    return hi.double() + (w - hi).bfloat16().double()


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 16, 17, 50])
def test_tiles_within_their_bf16_terms_of_the_exact_product(kind, rows):
    k = width(kind, 96, 512)  # 3 groups (an odd unit count) for 32-wide blocks, 2 super-blocks
    bw, ref, _ = weight(kind, 48, k, seed=rows)
    x = torch.randn(rows, k)
    x[0, :32] = 0  # a group of zeros
    ref = torch.as_tensor(ref)
    exact = x.double() @ ref.double().T
    got = quant_kernel.blocked_linear_amx(x, bw).double()
    assert ((got - exact).abs() <= amx_bound(x, ref, kind)).all()
    if kind in AMX_ONE_TERM:  # bf16(x) times the weights (Q6_K's as two bf16 planes), to fp32's rounding
        w = two_planes(ref) if kind == "Q6_K" else ref
        rounded = x.bfloat16().double() @ w.double().T
        assert ((got - rounded).abs() <= fp32_bound(x, ref)).all()
    else:  # closer than the VNNI kernel's two int8 terms on the whole
        vnni = quant_kernel.blocked_linear(x, bw, amx=False).double()
        assert (got - exact).abs().sum() < 0.5 * (vnni - exact).abs().sum()


@pytest.mark.parametrize("super_blocks", [1, 3])
@pytest.mark.parametrize("kind", ["Q3_K", "Q6_K"])
def test_super_block_formats_over_odd_counts_of_super_blocks(kind, super_blocks):
    # Q3_K folds its sub-block scales into the tiles' B and sums a super-block's 8 groups in one tile
    # (runs of 8 units, 1 and 3 of them); Q6_K all of its scale (two bf16 planes), the whole span in one
    k = 256 * super_blocks
    bw, ref, _ = weight(kind, 32, k, seed=super_blocks)
    ref = torch.as_tensor(ref)
    x = torch.randn(20, k)
    got = quant_kernel.blocked_linear_amx(x, bw).double()
    assert ((got - x.double() @ ref.double().T).abs() <= amx_bound(x, ref, kind)).all()


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_1", "Q4_K", "Q6_K", "Q3_K"])
@pytest.mark.parametrize("k", [1536, 2304])
def test_wide_inputs_run_in_spans_whose_sums_add_up(kind, k):
    # 1,536 inputs: one span of 48 groups (kOneSpanGroups); 2,304: spans of 32 groups (1,024 inputs),
    # the last one 8 groups (a single super-block)
    bw, ref, _ = weight(kind, 48, k, seed=5)
    ref = torch.as_tensor(ref)
    x = torch.randn(33, k)
    got = quant_kernel.blocked_linear_amx(x, bw).double()
    assert ((got - x.double() @ ref.double().T).abs() <= amx_bound(x, ref, kind)).all()


def assert_rows_alone_and_threads_alike(linear, x: torch.Tensor, rows: tuple[int, ...]) -> None:
    """linear(x) on 1 and 2 threads bit for bit, and each of `rows` alone equal to its row of it."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x)
        torch.set_num_threads(2)
        two = linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for i in rows:
        assert torch.equal(linear(x[i : i + 1])[0], two[i])


@pytest.mark.parametrize("kind", ["Q5_0", "Q6_K", "Q4_K"])
def test_a_rows_result_does_not_depend_on_the_other_rows_or_threads(kind):
    k = width(kind, 128, 256)
    bw, _, _ = weight(kind, 256, k)
    # first / last of a tile, a tile's first, the padded tile's only row
    assert_rows_alone_and_threads_alike(lambda x: quant_kernel.blocked_linear_amx(x, bw), torch.randn(70, k), (0, 15, 16, 69))


def test_linear_takes_the_tiles_from_their_row_count():
    bw, _, _ = weight("Q8_0", 64, 128)
    first = int(torch.ops.tokenmill_vnni.amx_min_rows())
    x = torch.randn(first, 128)
    assert torch.equal(quant_kernel.blocked_linear(x, bw), quant_kernel.blocked_linear_amx(x, bw))
    fewer = x[: first - 1]
    assert torch.equal(quant_kernel.blocked_linear(fewer, bw), quant_kernel.blocked_linear(fewer, bw, amx=False))
    assert not torch.equal(quant_kernel.blocked_linear_amx(fewer, bw), quant_kernel.blocked_linear(fewer, bw, amx=False))
    # one int8 term stays on the VNNI kernel at any row count
    assert torch.equal(quant_kernel.blocked_linear(x, bw, terms=1), quant_kernel.blocked_linear(x, bw, terms=1, amx=False))


def test_parts_of_a_fused_linear_in_different_formats_write_their_own_columns():
    k = 256
    parts = [weight(kind, n, k, seed=i)[0] for i, (kind, n) in enumerate([("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 48)])]
    x = torch.randn(64, k)
    fused = quant_kernel.bound_blocked_linear_parts(parts)(x)
    assert torch.equal(fused, torch.cat([quant_kernel.blocked_linear_amx(x, w) for w in parts], dim=1))


def test_the_cap_below_amx_turns_the_tiles_off():
    code = ("import torch; from tokenmill.model.kernels import quant_kernel as q; "
            "print(q.vnni_available(), q.amx_available())")
    env = {**os.environ, "TOKENMILL_CPU_ISA": "avx512"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]
    with pytest.raises(RuntimeError, match="AMX"):
        env_code = ("import torch; from tests.model.test_block_decoders import weight; "
                    "from tokenmill.model.kernels import quant_kernel as q; "
                    "q.blocked_linear_amx(torch.randn(2, 32), weight('Q8_0', 16, 32)[0])")
        run = subprocess.run([sys.executable, "-c", env_code], env=env, capture_output=True, text=True)
        raise RuntimeError(run.stderr[-400:]) if run.returncode else AssertionError("ran without AMX")


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_K", "Q4_0", "Q5_0"])
@pytest.mark.parametrize("rows", [48, 100])  # whole tiles of rows (read in place); a partial last tile
def test_a_bf16_input_gives_the_results_of_its_float32_values(kind, rows):
    # The one-term formats without mins read bf16(x) alone: a bf16 x is taken as it is, with the results
    # of the float32 x it was rounded from; the others convert it (the results of its float32 values).
    # The silu epilogue gives bf16 for a bf16 x: its float32 sums rounded as the split rounds them.
    k = width(kind, 128, 512)
    bw, _, _ = weight(kind, 64, k, seed=5)
    x = torch.randn(rows, k)
    xb = x.bfloat16()
    got = quant_kernel.blocked_linear(xb, bw)
    assert got.dtype == torch.float32
    assert torch.equal(got, quant_kernel.blocked_linear(xb.float(), bw))
    one_term = kind in ("Q8_0", "Q6_K")
    assert quant_kernel.tiles_take_bf16(bw) == one_term
    assert torch.equal(got, quant_kernel.blocked_linear(x, bw)) == one_term
    assert not quant_kernel.tiles_take_bf16(bw, two_tile_terms=True)
    silu = quant_kernel.bound_blocked_silu_mul(bw)
    if silu is not None:
        out = silu(xb)
        assert out.dtype == torch.bfloat16 and torch.equal(out, silu(xb.float()).bfloat16())


@pytest.mark.parametrize("kind", sorted(AMX_ONE_TERM))
def test_asked_for_two_terms_a_one_term_format_takes_them(kind):
    # two_tile_terms (the lm_head's): both bf16 terms again, within their bound and far closer
    k = width(kind, 96, 512)
    bw, ref, _ = weight(kind, 48, k, seed=3)
    ref = torch.as_tensor(ref)
    x = torch.randn(50, k)
    exact = x.double() @ ref.double().T
    two = quant_kernel.blocked_linear(x, bw, two_tile_terms=True).double()
    assert ((two - exact).abs() <= amx_bound(x, ref, "two terms")).all()
    assert torch.equal(two, quant_kernel.blocked_linear_amx(x, bw, two_tile_terms=True).double())
    one = quant_kernel.blocked_linear(x, bw).double()
    assert (two - exact).abs().sum() < 0.05 * (one - exact).abs().sum()


def test_a_models_lm_head_takes_both_terms(tmp_path):
    # a prompt's logits (prompt_logprobs, a 48+-row decode step) from the tiles' two terms: the IQ4_XS
    # mix's Q8_0 lm_head on one term fell from 99.10 to 98.77 % top-1 against exact
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=128, intermediate_size=256)
    gguf = write_tiny_gguf(folder, tmp_path / "tiny.gguf", quant="Q8_0")
    config = EngineConfig(model=str(gguf), precision="fast", num_threads=2, kv_cache_tokens=256)
    head = build_engine_core(config).runner.model.lm_head
    assert head.weight.kind == "Q8_0"
    x = torch.randn(64, head.weight.shape[1])
    assert torch.equal(head(x), quant_kernel.blocked_linear(x, head.weight, two_tile_terms=True))
    assert not torch.equal(head(x), quant_kernel.blocked_linear(x, head.weight))
