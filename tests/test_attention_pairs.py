"""Runs over bf16 and int8 caches on CPUs with AVX512-BF16 (csrc/paged_attention_pairs.h): q and the
softmax weights rounded to bf16, every sum in fp32. Checked against that arithmetic done in float64
(so a wrong pair, page edge or scale shows, not just "close to attention"), against the fp32 products
(the rounding stays small), and fp32 caches (exact mode) keep fp32 products."""

from __future__ import annotations

import pytest
import torch

from tests.test_cpu_attention_kernel import PAIRS_ISA, RUN_CASES, make_runs, naive, per_head
from tokenmill.model import cpu_attention_kernel as kernel
from tokenmill.model.kv_cache_format import INT8_SCALE_BYTES, KVCacheFormat, rotate

INT8 = KVCacheFormat.named("int8")
LANES = 16  # a run is one item per KV head when its rows x group query vectors pass half a vector
MAX_RUN_ROWS = 16  # csrc/paged_attention_common.h kMaxRunRows


@pytest.fixture(scope="module")
def pairs():
    if kernel.disabled() or not kernel.available():
        pytest.skip("no C++ attention kernel")
    if kernel.best_isa() < PAIRS_ISA:
        pytest.skip("this CPU has no AVX512-BF16")


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().bfloat16().double()


def pair_rows(runs: list[tuple[int, int]], group: int) -> list[bool]:
    """Which rows the kernel plans into runs (the rest go one at a time, in fp32)."""
    flags = []
    for _start, n in runs:
        for first in range(0, max(n, 1), MAX_RUN_ROWS):
            rows = min(MAX_RUN_ROWS, n - first) if n else 1
            flags += [rows > 1 and 2 * rows * group > LANES] * rows
    return flags


def naive_pairs(q, k_values, v_codes, v_scales, table, lens, page_size, scale):
    """The pair path's arithmetic in float64: scores from bf16(q) and the cache's K values; each
    weight times its V row's scale rounded to bf16, times the row's codes (a bf16 cache: scale 1,
    codes the values); the denominator the unrounded weights."""
    def attend(row, h, kvh, slots):
        scores = k_values[kvh, slots].double() @ bf16(q[row, h]) * scale
        weights = torch.exp(scores - scores.max())
        rounded = bf16(weights * v_scales[kvh, slots].double())
        return rounded @ v_codes[kvh, slots].double() / weights.sum()

    return per_head(q, k_values.shape[0], table, lens, page_size, attend)


def check(runs, kv_heads, group, head_dim, page_size, q, k_cache, v_cache, table, lens, k_values, v_codes, v_scales,
          rotated: bool = False):
    """`rotated`: the cache holds H x (int8 rows): the kernel attends with H q and rotates its output back."""
    scale = head_dim**-0.5

    def attend(isa: int, threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        return kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, page_size, scale, isa=isa).double()

    before = torch.get_num_threads()
    try:
        # One thread: no run is split over parts of its pages (a part rounds its weights relative to
        # its own maximum, so the reference would have to know the parts).
        out, fp32 = attend(PAIRS_ISA, 1), attend(PAIRS_ISA - 1, 1)
        split = [attend(PAIRS_ISA, n) for n in (2, 3)]
    finally:
        torch.set_num_threads(before)
    paired = torch.tensor(pair_rows(runs, group))
    assert paired.any(), "the case plans no run"
    if rotated:
        ref = rotate(naive_pairs(rotate(q), k_values, v_codes, v_scales, table, lens, page_size, scale)).double()
    else:
        ref = naive_pairs(q, k_values, v_codes, v_scales, table, lens, page_size, scale)
    ref[~paired] = fp32[~paired]  # rows alone keep fp32 products (checked by the other kernel tests)
    # (a weight at a bf16 rounding boundary may round the other way from fp32 exp: one ulp of it;
    # rotated, that ulp times a V row lands on every value of the output vector)
    tol = 3e-4 if rotated else 1e-4
    torch.testing.assert_close(out, ref, atol=tol, rtol=1e-4)
    # bf16 rounding, not an error: scores of a few units (q * 3), values of one
    differs = (out - fp32)[paired].abs().max().item()
    assert 0 < differs < 0.05
    for more in split:  # runs split over threads round against each part's maximum: within that
        torch.testing.assert_close(more, out, atol=0.01, rtol=0.01)


# The last run cases, and an odd page size: pairs of rows then cross pages, so V is taken a page at a
# time instead of in chunks of pages (paged_attention_runs.h).
CASES = [case for case in RUN_CASES if any(n > 1 for _s, n in case[0])][-6:] + [([(41, 12), (3, 6)], 2, 3, 64, 5)]


@pytest.mark.parametrize("runs,kv_heads,group,head_dim,page_size", CASES)
def test_runs_over_a_bf16_cache_multiply_bf16_pairs(pairs, runs, kv_heads, group, head_dim, page_size):
    q, k_cache, v_cache, table, lens = make_runs(runs, kv_heads, group, head_dim, page_size, seed=7,
                                                 dtype=torch.bfloat16)
    check(runs, kv_heads, group, head_dim, page_size, q, k_cache, v_cache, table, lens,
          k_cache.double(), v_cache.double(), torch.ones(v_cache.shape[:2]))


@pytest.mark.parametrize("runs,kv_heads,group,head_dim,page_size", CASES)
def test_runs_over_an_int8_cache_fold_the_row_scales_into_fp32(pairs, runs, kv_heads, group, head_dim, page_size):
    q, k, v, table, lens = make_runs(runs, kv_heads, group, head_dim, page_size, seed=8)
    k8, v8 = INT8.encode(k), INT8.encode(v)
    k_scales = k8[..., :INT8_SCALE_BYTES].contiguous().view(torch.float32)
    v_scales = v8[..., :INT8_SCALE_BYTES].contiguous().view(torch.float32).squeeze(-1)
    # the rows hold codes of H k and H v (kv_cache_format.py): the arithmetic happens in H's frame
    check(runs, kv_heads, group, head_dim, page_size, q, k8, v8, table, lens,
          k8[..., INT8_SCALE_BYTES:].float() * k_scales, v8[..., INT8_SCALE_BYTES:].float(), v_scales,
          rotated=True)


def test_an_fp32_cache_keeps_fp32_products(pairs):
    runs, kv_heads, group, head_dim, page_size = CASES[0]
    q, k_cache, v_cache, table, lens = make_runs(runs, kv_heads, group, head_dim, page_size, seed=9)
    out = kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, page_size, head_dim**-0.5, isa=PAIRS_ISA)
    ref = naive(q, k_cache, v_cache, table, lens, page_size, head_dim**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
