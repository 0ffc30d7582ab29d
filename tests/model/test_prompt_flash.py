"""The prompt attention kernel on AMX tiles (csrc/prompt_flash_amx.h): causal attention of a chunk's
queries at the end of its context against a float64 reference, over the shapes that exercise its
blocking (query blocks of 16, key chunks of 256, up to 4 query heads a KV head at once, head dims padded
to 32), its bf16 output, strided inputs, and the errors that name what is wrong."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tokenmill.model.kernels import fused_ops, prompt_flash
from tokenmill.model.kv_cache_format import KVCacheFormat

pytestmark = pytest.mark.skipif(not prompt_flash.available(), reason="no AMX tiles here for the kernel")

# bf16 scores' products and bf16 weights (8 bits), fp32 sums: outputs, weighted means of values
# ~N(0, 1), within a few bf16 steps of the float64 result.
BOUND = dict(atol=2.5e-2, rtol=2e-2)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of q [Q, H, D] at the last Q positions of k, v [KVH, T, D]."""
    q_len, heads, _ = q.shape
    kvh, kv_len, _ = k.shape
    group = heads // kvh
    keys, values = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = torch.einsum("qhd,htd->hqt", q.double(), keys) * scale
    seen = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hqt,htd->qhd", probs, values)


def inputs(q_len: int, kv_len: int, heads: int, kvh: int, hd: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    def randn(*shape):
        return torch.randn(*shape, generator=g).bfloat16()
    return randn(q_len, heads, hd), randn(kvh, kv_len, hd), randn(kvh, kv_len, hd)


@pytest.mark.parametrize("q_len, kv_len, heads, kvh, hd", [
    (40, 40, 9, 3, 64),  # a fresh prompt, SmolLM2's heads: three query heads a KV head at once
    (1000, 2000, 9, 3, 64),  # a long chunk after its prefix: many key chunks, the diagonal in the last
    (24, 70, 8, 2, 128),  # four query heads a KV head
    (17, 17, 4, 1, 256),  # Gemma's head dim, one KV head; a query block of one row
    (33, 300, 10, 2, 32),  # five query heads a KV head: a part of four and one of one
    (5, 300, 6, 2, 80),  # a head dim that is no multiple of 32: padded with zero dims
    (1, 257, 2, 2, 64),  # one query (MHA), a context one key past a chunk
    (128, 512, 4, 4, 16),  # the context exactly two chunks, queries exactly eight blocks
])
def test_matches_float64_causal_attention(q_len, kv_len, heads, kvh, hd):
    q, k, v = inputs(q_len, kv_len, heads, kvh, hd, seed=kv_len)
    scale = hd**-0.5
    got = prompt_flash.attend_rows(q, k, v, scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, k, v, scale), **BOUND)
    # bf16_out: the same float32 result rounded once
    assert torch.equal(prompt_flash.attend_rows(q, k, v, scale, True), got.bfloat16())


def test_large_scores_and_the_scale_given():
    # scores in the hundreds (a softmax that is nearly one-hot) and a scale other than 1 / sqrt(hd)
    q, k, v = inputs(50, 400, 4, 2, 64, seed=7)
    q = q * 8
    got = prompt_flash.attend_rows(q, k, v, 0.3)
    torch.testing.assert_close(got.double(), reference(q, k, v, 0.3), **BOUND)
    assert torch.isfinite(got).all()


def test_strided_inputs_read_as_their_strides_say():
    q, k, v = inputs(30, 90, 6, 2, 64, seed=3)
    # queries as a column slice of a wider projection, K/V as the first 90 positions of longer rows
    wide = torch.cat([q, torch.full_like(q, 9.0)], dim=1)[:, :6]
    long_k = torch.cat([k, torch.full_like(k, 9.0)], dim=1)[:, :90]
    long_v = torch.cat([v, torch.full_like(v, 9.0)], dim=1)[:, :90]
    assert not wide.is_contiguous() and not long_k.is_contiguous()
    want = prompt_flash.attend_rows(q, k, v, 0.125)
    assert torch.equal(prompt_flash.attend_rows(wide, long_k, long_v, 0.125), want)


def test_bad_inputs_are_errors_that_name_the_problem():
    q, k, v = inputs(8, 16, 4, 2, 64)
    with pytest.raises(RuntimeError, match=r"q must be a bfloat16 \[Q, H, D\] tensor"):
        prompt_flash.attend_rows(q.float(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        prompt_flash.attend_rows(*inputs(8, 16, 4, 2, 24), 0.125)
    with pytest.raises(RuntimeError, match="more queries than keys"):
        prompt_flash.attend_rows(*inputs(20, 16, 4, 2, 64), 0.125)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        prompt_flash.attend_rows(*inputs(8, 16, 5, 2, 64), 0.125)
    with pytest.raises(RuntimeError, match="k_cache and v_cache must be caches of one shape"):
        prompt_flash.attend_rows(q, k, v[:, :8], 0.125)
    pages = torch.tensor([1, 0])
    with pytest.raises(RuntimeError, match=r"pages\[0\] = 1 is outside the cache's 1 pages"):
        prompt_flash.attend(q, k, v, pages, 16, 16, 0.125)
    with pytest.raises(RuntimeError, match="pages holds 1 pages; 16 keys need 2"):
        prompt_flash.attend(q, k, v, pages[1:], 16, 8, 0.125)
    with pytest.raises(RuntimeError, match="unrotate is for int8 rows"):
        prompt_flash.attend(q, k, v, pages[1:], 16, 16, 0.125, unrotate=True)
    with pytest.raises(RuntimeError, match="out must be a contiguous"):
        prompt_flash.attend(q, k, v, pages[1:], 16, 16, 0.125, out=torch.empty(8, 4, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt, unrotate", [("bf16", False), ("int8", False), ("int8", True)])
def test_reads_the_context_from_shuffled_cache_pages(fmt, unrotate):
    """K / V read through the page list from a pool of pages, as the engine stores them: bf16 rows,
    int8 rows in H's basis as they are (the caller rotates its queries and outputs), or turned back."""
    page, kvh, hd, kv_len = 16, 2, 64, 150
    g = torch.Generator().manual_seed(11)
    pool = 16 * page
    k, v = torch.randn(kvh, pool, hd, generator=g), torch.randn(kvh, pool, hd, generator=g)
    k[..., 3] *= 5  # an outlier channel, as keys have
    cache = KVCacheFormat.named(fmt)
    k_cache, v_cache = cache.encode(k), cache.encode(v)
    pages = torch.tensor([9, 2, 14, 0, 5, 11, 7, 3, 12, 1])  # 150 keys over ten shuffled pages
    slots = torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages.tolist()])[:kv_len]
    # as stored (int8: code x scale, H x), or turned back out of H's basis (H (H x) = x)
    values_of = cache.decode if unrotate else partial(cache.stored_values, dtype=torch.float32)
    keys, values = values_of(k_cache[:, slots]), values_of(v_cache[:, slots])
    assert fmt == "bf16" or cache.rotated(hd)
    q = torch.randn(40, 6, hd, generator=g).bfloat16()
    got = prompt_flash.attend(q, k_cache, v_cache, pages, kv_len, page, 0.125, unrotate=unrotate)
    torch.testing.assert_close(got.double(), reference(q, keys.bfloat16(), values.bfloat16(), 0.125), **BOUND)
    if fmt == "int8" and fused_ops.available():  # the rows decoded as int8_rows_values decodes them, to the bit
        rows_k, rows_v = (fused_ops.int8_rows_values(c[:, slots], unrotate) for c in (k_cache, v_cache))
        assert torch.equal(got, prompt_flash.attend_rows(q, rows_k, rows_v, 0.125))
    # into a given output, the same numbers
    out = torch.empty(40, 6, hd)
    assert prompt_flash.attend(q, k_cache, v_cache, pages, kv_len, page, 0.125, unrotate=unrotate, out=out) is out
    assert torch.equal(out, got)


def test_bf16_pages_read_in_place_ignore_what_lies_past_the_context():
    """bf16 keys are read as tiles straight from whole-tile pages: the last page's slots past the
    context (a freed page's stale rows, or NaN) change nothing."""
    q, k, v = inputs(20, 150, 6, 2, 64, seed=5)
    page, pool = 16, 10 * 16
    k_cache, v_cache = torch.zeros(2, pool, 64, dtype=torch.bfloat16), torch.zeros(2, pool, 64, dtype=torch.bfloat16)
    k_cache[:, :150], v_cache[:, :150] = k, v
    pages = torch.arange(10)
    clean = prompt_flash.attend(q, k_cache, v_cache, pages, 150, page, 0.125)
    k_cache[:, 150:], v_cache[:, 150:] = float("nan"), float("nan")
    assert torch.equal(prompt_flash.attend(q, k_cache, v_cache, pages, 150, page, 0.125), clean)
    torch.testing.assert_close(clean.double(), reference(q, k, v, 0.125), **BOUND)
    # pages of half a tile are packed first: the same keys, the same products, the same numbers
    assert torch.equal(prompt_flash.attend(q, k_cache, v_cache, torch.arange(20), 150, 8, 0.125), clean)


@pytest.mark.parametrize("q_len, kv_len, page, fmt", [
    (64, 1008, 16, "bf16"),  # a decode step's rows over a shared prefix, keys in place
    (50, 40, 8, "bf16"),  # more queries than keys; pages of half a tile: the keys packed
    (7, 300, 16, "int8"),  # one part-filled query block; int8 rows in H's basis as stored
])
def test_not_causal_every_query_sees_every_key_and_its_softmax_stats(q_len, kv_len, page, fmt):
    """Cascade attention's shared prefix (csrc/cascade_attention.h): every query attends all kv_len keys,
    and `stats` gets its softmax max (of the scaled scores) and sum, whose log-sum-exp merges the
    prefix's part with the rest of a row's keys."""
    heads, kvh, hd, scale = 9, 3, 64, 0.125
    g = torch.Generator().manual_seed(kv_len)
    pool = -(-kv_len // page) * page
    cache = KVCacheFormat.named(fmt)
    k_cache, v_cache = (cache.encode(torch.randn(kvh, pool, hd, generator=g)) for _ in range(2))
    keys, values = (cache.stored_values(c[:, :kv_len], dtype=torch.float32).bfloat16() for c in (k_cache, v_cache))
    q = torch.randn(q_len, heads, hd, generator=g).bfloat16()
    stats = torch.empty(q_len, heads, 2)
    got = prompt_flash.attend(q, k_cache, v_cache, torch.arange(pool // page), kv_len, page, scale, causal=False,
                              stats=stats)
    scores = torch.einsum("qhd,htd->hqt", q.double(), keys.double().repeat_interleave(3, 0)) * scale
    want = torch.einsum("hqt,htd->qhd", torch.softmax(scores, -1), values.double().repeat_interleave(3, 0))
    torch.testing.assert_close(got.double(), want, **BOUND)
    lse = (stats[..., 0].double() + stats[..., 1].double().log())
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).T, atol=2e-2, rtol=0)
    torch.testing.assert_close(stats[..., 0].double(), scores.amax(-1).T, atol=2e-2, rtol=0)
    with pytest.raises(RuntimeError, match=r"stats must be a contiguous float32 \[Q, H, 2\]"):
        prompt_flash.attend(q, k_cache, v_cache, torch.arange(pool // page), kv_len, page, scale, causal=False,
                            stats=torch.empty(q_len, heads, 3))
