"""silu(gate) * up in the AMX-BF16 tiles' epilogue (csrc/quant_amx.h `multiply_silu_mul`): the same bits
as the product written out and fused_ops.silu_mul after it, for every format whose tiles take units of
32 inputs and any row count the tiles take; the weights it does not take (Q2_K's units of 16, inputs
over one span) refused by name; the layers and the gated MLP that call it. Skipped where the CPU (or
TOKENMILL_CPU_ISA) has no AMX."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_block_decoders import weight, width
from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model.kernels import fused_ops, quant_kernel
from tokenmill.model.layers.quantized_linear import QuantizedLinear, gated_silu

pytestmark = pytest.mark.skipif(not quant_kernel.amx_available() or not fused_ops.available(),
                                reason="no AMX-BF16 tiles or fused ops here")


def separate(x: torch.Tensor, bw) -> torch.Tensor:
    return fused_ops.silu_mul(quant_kernel.blocked_linear_amx(x, bw))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_1", "IQ4_NL", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("rows", [48, 61, 130])
@pytest.mark.parametrize("wide", [False, True])
def test_the_epilogue_gives_the_bits_of_the_product_and_silu_mul_after_it(kind, rows, wide):
    k = 1536 if wide else width(kind, 96, 512)  # 1,536 inputs: the widest one span takes
    bw, _, _ = weight(kind, 2 * 48, k, seed=rows)  # gate and up of 48 columns each: 3 blocks (an odd count)
    fused = quant_kernel.bound_blocked_silu_mul(bw)
    assert fused is not None
    x = torch.randn(rows, k)
    x[3] = 0  # a row of zeros: silu(0) * 0
    x[5] *= 40  # large sums: the sigmoid's both sides saturate
    out = fused(x)
    assert out.shape == (rows, 48)
    assert torch.equal(out, separate(x, bw))


def test_weights_the_epilogue_does_not_take_are_refused_by_name():
    q2k, _, _ = weight("Q2_K", 64, 256)  # units of 16 inputs
    wide, _, _ = weight("Q8_0", 64, 2048)  # spans of 1,024 inputs: the sums would add after the epilogue
    for bw in (q2k, wide):
        assert quant_kernel.bound_blocked_silu_mul(bw) is None
        with pytest.raises(RuntimeError, match="does not fuse"):
            torch.ops.tokenmill_vnni.linear_silu_mul(torch.randn(48, bw.shape[1]), *quant_kernel.blocked_args(bw))


def test_the_layer_takes_the_epilogue_from_the_tiles_row_count(monkeypatch):
    bw, _, _ = weight("Q4_K", 64, 256)
    layer = QuantizedLinear(bw, None, prompt_gemm="vnni")
    calls = []
    fused = layer._silu_mul
    monkeypatch.setattr(layer, "_silu_mul", lambda x: calls.append(x.shape[0]) or fused(x))
    first = quant_kernel.amx_min_rows()
    for rows in (1, first - 1, first, 200):
        x = torch.randn(rows, 256)
        assert torch.equal(layer.silu_mul(x), fused_ops.silu_mul(layer(x)))
    assert calls == [first, 200]
    # a layer whose prompts take the bf16 GEMM keeps silu_mul after it there
    bf16 = QuantizedLinear(bw, None, prompt_gemm="bf16")
    x = torch.randn(400, 256)
    assert torch.equal(bf16.silu_mul(x), fused_ops.silu_mul(bf16(x)))
    # gated_silu: the layer's silu_mul, or silu_mul after any other linear
    assert torch.equal(gated_silu(layer, x[:64]), layer.silu_mul(x[:64]))
    dense = torch.nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        assert torch.equal(gated_silu(dense, x[:64]), fused_ops.silu_mul(dense(x[:64])))


def test_a_gated_mlp_runs_its_activation_in_the_tiles(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=128, intermediate_size=256)
    gguf = write_tiny_gguf(folder, tmp_path / "tiny.gguf", quant="Q8_0")
    config = EngineConfig(model=str(gguf), precision="fast", num_threads=2, kv_cache_tokens=256, prompt_gemm="vnni")
    layer = build_engine_core(config).runner.model.layers[0]
    assert layer.gate_up._silu_mul is not None
    h = torch.randn(64, 128)
    assert torch.equal(layer.mlp_fused(h), layer.down(fused_ops.silu_mul(layer.gate_up(h))))
