"""The fused elementwise ops of the fast path (csrc/fused_ops.cpp) against the eager PyTorch steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.kernels import fused_ops
from tokenmill.model.kv_cache_format import KVCacheFormat, rotate
from tokenmill.model.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="the C++ ops could not be built here")


@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: split over threads
def test_rope_on_fused_projection(rows):
    nq, nkv, d = 9, 3, 64
    qkv = torch.randn(rows, (nq + 2 * nkv) * d)
    cos, sin = torch.randn(rows, d), torch.randn(rows, d)
    q, k = fused_ops.rope_qk(qkv, cos, sin, nq, nkv)
    ref = RotaryEmbedding.apply(qkv[:, : (nq + nkv) * d].reshape(rows, nq + nkv, d), cos.unsqueeze(1), sin.unsqueeze(1))
    torch.testing.assert_close(torch.cat([q, k], dim=1), ref)

    k_cache, v_cache = torch.zeros(nkv, 100, d), torch.zeros(nkv, 100, d)
    slots = torch.randperm(100)[:rows]
    q2 = fused_ops.rope_store(qkv, cos, sin, nq, nkv, k_cache, v_cache, slots)
    torch.testing.assert_close(q2, q)
    torch.testing.assert_close(k_cache[:, slots].transpose(0, 1), k)
    torch.testing.assert_close(v_cache[:, slots].transpose(0, 1), qkv[:, (nq + nkv) * d :].reshape(rows, nkv, d))
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[slots] = False
    assert k_cache[:, untouched].abs().sum() == 0 and v_cache[:, untouched].abs().sum() == 0
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused_ops.rope_store(qkv, cos, sin, nq, nkv, k_cache, v_cache, torch.full((rows,), 100))
    # A bf16 cache (fast mode) gets the same values rounded as torch rounds them.
    k16, v16 = torch.zeros(nkv, 100, d, dtype=torch.bfloat16), torch.zeros(nkv, 100, d, dtype=torch.bfloat16)
    fused_ops.rope_store(qkv, cos, sin, nq, nkv, k16, v16, slots)
    assert torch.equal(k16[:, slots].transpose(0, 1), k.bfloat16())
    assert torch.equal(v16[:, slots].transpose(0, 1), qkv[:, (nq + nkv) * d :].reshape(rows, nkv, d).bfloat16())


@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_and_residual_norm(rows):
    gate_up = torch.randn(rows, 2 * 1536) * 4  # wide range: the exp approximation on both signs
    torch.testing.assert_close(fused_ops.silu_mul(gate_up), F.silu(gate_up[:, :1536]) * gate_up[:, 1536:],
                               atol=1e-5, rtol=1e-5)
    x, delta, w = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    x_in_place = x.clone()
    h = fused_ops.add_rms_norm_(x_in_place, delta, w, 1e-5)
    torch.testing.assert_close(x_in_place, x + delta)
    torch.testing.assert_close(h, F.rms_norm(x + delta, (576,), w, 1e-5))


@pytest.mark.parametrize("rows", [1, 40])
def test_bf16_inputs_and_outputs_are_the_float32_results_rounded(rows):
    """Large prefill steps keep the linears' activations in bf16: each op reads bf16 as the float32
    it stands for and rounds its output as torch rounds to bf16 (ties to even)."""
    gate_up = (torch.randn(rows, 2 * 1536) * 4).bfloat16()
    out = fused_ops.silu_mul(gate_up)
    assert out.dtype == torch.bfloat16 and torch.equal(out, fused_ops.silu_mul(gate_up.float()).bfloat16())

    x, delta, w = torch.randn(rows, 576), torch.randn(rows, 576).bfloat16(), torch.randn(576)
    x16, x32 = x.clone(), x.clone()
    h16 = fused_ops.add_rms_norm_(x16, delta, w, 1e-5, bf16_out=True)
    h32 = fused_ops.add_rms_norm_(x32, delta.float(), w, 1e-5)
    torch.testing.assert_close(x16, x32)  # the residual stream stays float32
    assert h16.dtype == torch.bfloat16
    # the sum of squares may be added in another order: at most one bf16 step apart
    torch.testing.assert_close(h16.float(), h32.bfloat16().float(), atol=0, rtol=2 ** -7)

    nq, nkv, d = 9, 3, 64
    qkv = torch.randn(rows, (nq + 2 * nkv) * d).bfloat16()
    cos, sin = torch.randn(rows, d), torch.randn(rows, d)
    k16, v16 = torch.zeros(nkv, 100, d, dtype=torch.bfloat16), torch.zeros(nkv, 100, d, dtype=torch.bfloat16)
    k32, v32 = k16.clone(), v16.clone()
    slots = torch.randperm(100)[:rows]
    q16 = fused_ops.rope_store(qkv, cos, sin, nq, nkv, k16, v16, slots)
    q32 = fused_ops.rope_store(qkv.float(), cos, sin, nq, nkv, k32, v32, slots)
    assert q16.dtype == torch.float32 and torch.equal(q16, q32)
    assert torch.equal(k16, k32) and torch.equal(v16, v32)


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
def test_rope_store_gives_bf16_queries_rounded_from_the_same_floats(rows, qkv_dtype):
    """A prompt step whose attention reads bf16 queries asks rope_store for them: the float32 queries
    rounded as torch rounds (ties to even), with K and V stored exactly as without."""
    nq, nkv, d = 9, 3, 64
    qkv = (torch.randn(rows, (nq + 2 * nkv) * d) * 3).to(qkv_dtype)
    cos, sin = torch.randn(rows, d), torch.randn(rows, d)
    caches = [torch.zeros(nkv, 100, d, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.randperm(100)[:rows]
    q32 = fused_ops.rope_store(qkv, cos, sin, nq, nkv, caches[0], caches[1], slots)
    q16 = fused_ops.rope_store(qkv, cos, sin, nq, nkv, caches[2], caches[3], slots, q_bf16=True)
    assert q16.dtype == torch.bfloat16 and q16.shape == (rows, nq, d) and q16.is_contiguous()
    assert torch.equal(q16, q32.bfloat16())
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("T, H, n", [(40, 1024, 7), (3, 64, 3), (300, 576, 1)])
def test_weighted_index_add_is_mul_then_index_add(T, H, n):
    """A MoE expert's weighted outputs added to its tokens' rows in one pass: the product rounded,
    then the sum (no fused multiply-add), bit for bit as y.mul_(w) then index_add_."""
    g = torch.Generator().manual_seed(T + n)
    out = torch.randn(T, H, generator=g)
    y = torch.randn(n, H, generator=g) * 3
    w = torch.rand(n, 1, generator=g)
    rows = torch.randperm(T, generator=g)[:n]
    want = out.clone().index_add_(0, rows, y.clone().mul_(w))
    fused_ops.weighted_index_add_(out, rows, y, w)
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match="outside out"):
        fused_ops.weighted_index_add_(out, torch.full((n,), T), y, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_attention_is_the_torch_expression_in_one_pass(dtype):
    """A long chunk's attention over its prefix and over itself, merged by the prefix's share: bit for
    bit own + (prefix - own) * share on float32 tensors, in the flash kernel's [1, H, L, D] layout (L
    outermost in memory), and rounded once to bf16 when asked."""
    g = torch.Generator().manual_seed(7)
    H, L, D = 9, 37, 64
    own = torch.randn(1, L, H, D, generator=g).to(dtype).transpose(1, 2)  # the flash kernel's strides
    prefix = torch.randn(1, L, H, D, generator=g).to(dtype).transpose(1, 2)
    share = torch.rand(1, H, L, generator=g)
    o = own.float()
    want = o + (prefix.float() - o) * share.unsqueeze(-1)
    got = fused_ops.merge_attention(own, prefix, share)
    assert got.dtype == torch.float32 and got.stride() == own.stride() and torch.equal(got, want)
    got16 = fused_ops.merge_attention(own, prefix, share, bf16_out=True)
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, want.bfloat16())
    with pytest.raises(RuntimeError, match="one dtype and layout"):
        fused_ops.merge_attention(own, prefix.contiguous(), share)


@pytest.mark.parametrize("hd", [16, 64, 128, 256, 24])  # 24: a head dim whose rows are not rotated
def test_int8_rows_values_are_the_stored_values_in_one_pass(hd):
    """int8 cache rows (a scale, then codes of H x) as bf16 values: bit for bit the format's own
    code x scale rounded to bf16, and with `unrotate` the rotation back by the same butterflies as
    kv_cache_format.rotate, rounded once; rows of any leading shape and layout (a gathered slice)."""
    fmt = KVCacheFormat.named("int8")
    g = torch.Generator().manual_seed(hd)
    x = torch.randn(3, 70, hd, generator=g)
    x[..., 1] *= 8  # an outlier channel
    rows = fmt.encode(x)
    got = fused_ops.int8_rows_values(rows)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, fmt.stored_values(rows, torch.bfloat16))
    part = rows[:, 10:50]  # not contiguous
    assert torch.equal(fused_ops.int8_rows_values(part), fmt.stored_values(part, torch.bfloat16))
    if fmt.rotated(hd):
        back = fused_ops.int8_rows_values(rows, unrotate=True)
        assert torch.equal(back, rotate(fmt.stored_values(rows, torch.float32)).bfloat16())
        # the values it gives back are x's, to within int8 and bf16 rounding
        torch.testing.assert_close(back.float(), x, atol=0.1, rtol=0.02)
    else:
        with pytest.raises(RuntimeError, match="head_dim 24 are not rotated"):
            fused_ops.int8_rows_values(rows, unrotate=True)


def test_int8_rows_values_names_what_it_takes():
    with pytest.raises(RuntimeError, match="int8 cache rows"):
        fused_ops.int8_rows_values(torch.zeros(2, 68))
    with pytest.raises(RuntimeError, match="int8 cache rows"):
        fused_ops.int8_rows_values(torch.zeros(2, 4, dtype=torch.int8))
