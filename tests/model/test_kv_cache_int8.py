"""int8 KV cache rows (model/kv_cache_format.py): the format's own rounding bound, the C++ reader in
every attention skeleton (decode rows, runs of rows, plain loops) against a float64 reference of the
dequantized cache on every SIMD variant, the PyTorch path on the same rows, and the fused RoPE/store
op and the fused decode step writing rows that the op-by-op path agrees with."""

from __future__ import annotations

import pytest
import torch

from tests.test_cpu_attention_kernel import (
    CASES,
    RUN_CASES,
    fp32_product_isas,
    make_case,
    make_runs,
    naive,
    torch_path,
)
from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model import cpu_attention_kernel as kernel
from tokenmill.model.attention import PrefillSpan, TorchPagedAttention
from tokenmill.model.kernels import decode_step, fused_ops
from tokenmill.model.kv_cache_format import KVCacheFormat, rotate
from tokenmill.model.runner import ModelRunner, SeqChunk

INT8 = KVCacheFormat.named("int8")
needs_kernel = pytest.mark.skipif(kernel.disabled() or not kernel.available(), reason="no C++ attention kernel")


def test_rows_round_within_half_a_step_and_say_their_bytes():
    x = torch.randn(3, 50, 64) * torch.rand(3, 50, 1) * 10
    x[1, 7] = 0  # an all-zero row: scale 0, codes 0, no division by zero
    rows = INT8.encode(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 50, 68)
    back = INT8.decode(rows)
    # The codes are of H x (H orthonormal and symmetric: H H = I), each within half a step there.
    eye = torch.eye(64)
    torch.testing.assert_close(rotate(rotate(eye)), eye, atol=1e-6, rtol=0)
    torch.testing.assert_close(rotate(eye), rotate(eye).T, atol=0, rtol=0)
    rotated = rotate(x)
    scale = rotated.abs().amax(-1, keepdim=True) / 127
    assert ((rotate(back) - rotated).abs() <= scale / 2 * (1 + 1e-4) + 1e-6).all()
    assert torch.equal(back[1, 7], torch.zeros(64))
    # 30 layers x 3 KV heads x (64 codes + 4 scale bytes), K and V: 1.88x the tokens of bf16 per byte
    assert INT8.bytes_per_token(30, 3, 64) == 2 * 30 * 3 * 68
    assert KVCacheFormat.named("bf16").bytes_per_token(30, 3, 64) == 2 * 30 * 3 * 128


def test_the_rotation_spreads_an_outlier_channel_over_the_row():
    # Keys have a few channels far larger than the rest; a scale per row of the plain values leaves
    # the small channels a few levels, the rotated row does not.
    x = torch.randn(200, 64)
    x[:, 5] *= 30
    plain = x.abs().amax(-1, keepdim=True) / 127
    plain_error = (torch.round(x / plain) * plain - x).pow(2).mean().sqrt()
    error = (INT8.decode(INT8.encode(x)) - x).pow(2).mean().sqrt()
    assert error < 0.4 * plain_error
    # head dims that are not powers of two keep plain codes
    y = torch.randn(4, 48)
    y_scale = y.abs().amax(-1, keepdim=True) / 127
    assert ((INT8.decode(INT8.encode(y)) - y).abs() <= y_scale / 2 * (1 + 1e-5)).all()


def int8_case(case: tuple, maker=make_case):
    """A case's caches stored as int8 rows, and their dequantized float values."""
    q, k, v, table, lens = maker(*case)
    k8, v8 = INT8.encode(k), INT8.encode(v)
    return q, k8, v8, INT8.decode(k8), INT8.decode(v8), table, lens


@needs_kernel
@pytest.mark.parametrize("case", CASES)
def test_decode_rows_read_int8_rows(case):
    q, k8, v8, kf, vf, table, lens = int8_case(case)
    page_size, hd = case[4], case[3]
    ref = naive(q, kf, vf, table, lens, page_size, hd**-0.5)
    for isa in range(kernel.best_isa() + 1):
        out = kernel.paged_decode_attention(q, k8, v8, table, lens, page_size, hd**-0.5, isa=isa)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m, isa=isa: f"isa {isa}: {m}")
    # the PyTorch path (gather + matmul) dequantizes the same rows to the same numbers
    torch.testing.assert_close(torch_path(q, k8, v8, table, lens, page_size).double(), ref, atol=1e-5, rtol=1e-5)
    # and against the unquantized cache the difference is int8 rounding: small next to the values
    exact = naive(q, *make_case(*case)[1:3], table, lens, page_size, hd**-0.5)
    # (a score sums head_dim rounded products: its error grows as the square root of head_dim)
    assert (ref - exact).abs().max() < 0.06 * (hd / 64) ** 0.5


@needs_kernel
@pytest.mark.parametrize("case", RUN_CASES[::2])
def test_runs_of_rows_read_int8_rows(case):
    q, k8, v8, kf, vf, table, lens = int8_case((*case, len(case[0])), make_runs)
    page_size, hd = case[4], case[3]
    ref = naive(q, kf, vf, table, lens, page_size, hd**-0.5)
    for isa in fp32_product_isas(torch.int8):
        out = kernel.paged_decode_attention(q, k8, v8, table, lens, page_size, hd**-0.5, isa=isa)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m, isa=isa: f"isa {isa}: {m}")


def test_prompt_chunks_through_sdpa_read_int8_rows():
    """Exact-mode-style prompt chunks (gathered pages, SDPA) over int8 rows: the dequantized values."""
    g = torch.Generator().manual_seed(5)
    kvh, group, hd, page = 2, 3, 64, 16
    k = torch.randn(kvh, 8 * page, hd, generator=g)
    v = torch.randn(kvh, 8 * page, hd, generator=g)
    k8, v8 = INT8.encode(k), INT8.encode(v)
    pages = torch.tensor([5, 2, 7])
    span = PrefillSpan(0, 10, 40, pages)
    q = torch.randn(10, kvh * group, hd, generator=g)
    got = TorchPagedAttention(kvh * group, kvh, hd)._prefill(q, k8, v8, span, page)
    want = TorchPagedAttention(kvh * group, kvh, hd)._prefill(q, INT8.decode(k8), INT8.decode(v8), span, page)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not fused_ops.available(), reason="the C++ ops could not be built here")
@pytest.mark.parametrize("bf16_input", [False, True])
def test_rope_store_quantizes_k_and_v_rows(bf16_input):
    nq, nkv, d, rows = 9, 3, 64, 40
    qkv = torch.randn(rows, (nq + 2 * nkv) * d) * 3
    qkv = qkv.bfloat16() if bf16_input else qkv
    cos, sin = torch.randn(rows, d), torch.randn(rows, d)
    q, k = fused_ops.rope_qk(qkv, cos, sin, nq, nkv)
    k8, v8 = torch.zeros(nkv, 100, d + 4, dtype=torch.int8), torch.zeros(nkv, 100, d + 4, dtype=torch.int8)
    slots = torch.randperm(100)[:rows]
    q2 = fused_ops.rope_store(qkv, cos, sin, nq, nkv, k8, v8, slots)
    assert torch.equal(q2, q)
    v = qkv[:, (nq + nkv) * d :].float().reshape(rows, nkv, d)
    for cache, want in ((k8, k), (v8, v)):
        got = INT8.decode(cache[:, slots]).transpose(0, 1)
        # the codes of H x (csrc/kv_rotation.h's butterflies), each within half a step there
        step = rotate(want).abs().amax(-1, keepdim=True) / 127
        assert ((rotate(got) - rotate(want)).abs() <= step / 2 * (1 + 1e-4) + 1e-5).all()
        # the Python encoder makes the same rows, up to a code on an exact tie
        assert (INT8.encode(want.transpose(0, 1)).int() - cache[:, slots].int())[..., 4:].abs().max() <= 1
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[slots] = False
    assert not k8[:, untouched].any() and not v8[:, untouched].any()


@pytest.mark.skipif(not decode_step.available(), reason="needs the C++ kernels and AVX512-VNNI")
def test_fused_decode_step_writes_and_reads_int8_rows_as_the_layers_do(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=128, intermediate_size=256)
    gguf = write_tiny_gguf(folder, tmp_path / "tiny.gguf", quant="Q4_1")
    config = EngineConfig(model=str(gguf), precision="fast", num_threads=2, kv_cache_tokens=512, kv_cache_dtype="int8")
    runner = build_engine_core(config).runner
    assert runner.kv_caches[0][0].dtype == torch.int8
    model = runner.model
    assert model.fused_decode
    g = torch.Generator().manual_seed(1)
    prompts = [[int(t) for t in torch.randint(100, 250, (n,), generator=g)] for n in (37, 21, 50)]
    pages = [list(range(0, 4)), list(range(4, 6)), list(range(6, 10))]
    runner.execute([SeqChunk(p, 0, pg, sample=True) for p, pg in zip(prompts, pages)])
    chunks = [SeqChunk([7], 37, pages[0], sample=True),
              SeqChunk([8, 9, 10, 11], 21, pages[1], sample=True, num_logits=4),  # a speculative run
              SeqChunk([12], 50, pages[2], sample=True)]
    fused = runner.execute(chunks)
    assert model._decode_stack is not None
    fused_kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    model.fused_decode = False
    eager = runner.execute(chunks)
    torch.testing.assert_close(fused, eager, atol=2e-4 * eager.abs().max().item(), rtol=1e-4)
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))
    for (kf, vf), (ke, ve) in zip(fused_kv, runner.kv_caches):
        torch.testing.assert_close(INT8.decode(kf), INT8.decode(ke), atol=1e-4, rtol=1e-2)
        torch.testing.assert_close(INT8.decode(vf), INT8.decode(ve), atol=1e-4, rtol=1e-2)
    assert isinstance(ModelRunner(model, 4, 16, torch.int8).kv_format, KVCacheFormat)
    # the disk tier keys pages by the layout: rotated int8 rows never read as the plain ones of before
    assert ModelRunner(model, 4, 16, torch.int8).page_layout()[0].startswith("int8-hadamard;")
    assert ModelRunner(model, 4, 16, torch.bfloat16).page_layout()[0].startswith("bf16;")
