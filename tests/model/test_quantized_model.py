"""A GGUF whose matrices are Q4_0 / Q4_1 / Q8_0 runs with its weights kept quantized in fast mode
(at about the file's size in memory, close to the exact path's logits) and dequantized in exact mode;
a type the kernels lack runs as bf16 with one warning line."""

from __future__ import annotations

import os

import pytest
import torch

from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.errors import InvalidRequest
from tokenmill.model.kernels import quant_kernel
from tokenmill.model.layers.dense_linear import DenseLinear
from tokenmill.model.layers.factory import kernel_types
from tokenmill.model.layers.quantized_linear import QuantizedLinear
from tokenmill.model.loader import load_weights
from tokenmill.model.quant_formats import GGUFWeight
from tokenmill.model.runner import SeqChunk


def logits(core, ids: list[int]) -> torch.Tensor:
    pages = list(range(-(-len(ids) // core.runner.page_size)))
    return core.runner.execute([SeqChunk(ids, 0, pages, sample=True, all_logits=True)])


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1", "Q8_0"])
def quantized_gguf(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    folder = make_tiny_model(tmp, "llama", tokenizer=False, hidden_size=128, intermediate_size=256)
    return request.param, write_tiny_gguf(folder, tmp / "tiny.gguf", quant=request.param)


def test_matrices_stay_quantized_at_about_the_file_size(quantized_gguf):
    kind, path = quantized_gguf
    loaded = load_weights(str(path))
    matrices = [w for w in loaded.weights.values() if isinstance(w, GGUFWeight)]
    assert len(matrices) == 2 + 2 * 7 and {w.kind for w in matrices} == {kind}  # embed, lm_head, 7 a layer
    core = build_engine_core(EngineConfig(model=str(path), precision="fast", num_threads=1, kv_cache_tokens=256))
    model = core.runner.model
    assert isinstance(model.layers[0].qkv, QuantizedLinear) and isinstance(model.lm_head, QuantizedLinear)
    assert model.weight_bytes() <= 1.3 * os.path.getsize(path)
    exact = build_engine_core(EngineConfig(model=str(path), precision="exact", num_threads=1, kv_cache_tokens=256))
    assert isinstance(exact.runner.model.layers[0].qkv, DenseLinear)
    assert exact.runner.model.weight_bytes() > 3 * model.weight_bytes()  # fp32: 4 bytes a weight


@pytest.mark.skipif(not quant_kernel.available(), reason="the C++ kernel could not be built here")
def test_fast_path_logits_close_to_exact(quantized_gguf):
    _, path = quantized_gguf
    fast = build_engine_core(EngineConfig(model=str(path), precision="fast", num_threads=1, kv_cache_tokens=256))
    exact = build_engine_core(EngineConfig(model=str(path), precision="exact", num_threads=1, kv_cache_tokens=256))
    ids = [int(i) for i in torch.randint(100, 49152, (40,), generator=torch.Generator().manual_seed(0))]
    # 3 rows go through the packed kernel: fp32 activations (rounding-level differences only), or on
    # AVX512-VNNI int8 ones for 4-bit weights (within their rounding) ...
    a, b = logits(fast, ids[:3]), logits(exact, ids[:3])
    vnni = quant_kernel.vnni_available()
    if vnni:
        assert (a - b).abs().max() < 0.02 * b.abs().max()
    else:
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    # ... 40 rows through dequantize + bf16 GEMM: bf16 activations, so a looser bound.
    a, b = logits(fast, ids), logits(exact, ids)
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_dense_checkpoint_quantized_at_load(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen2", tokenizer=False, hidden_size=128, intermediate_size=256)
    dense = build_engine_core(EngineConfig(model=str(folder), precision="fast", num_threads=1, kv_cache_tokens=256))
    ids = list(range(100, 103))
    for scheme, bits in (("int8", 8), ("int4", 4)):
        core = build_engine_core(EngineConfig(model=str(folder), precision="fast", quantization=scheme,
                                              num_threads=1, kv_cache_tokens=256))
        model = core.runner.model
        assert isinstance(model.layers[0].qkv, QuantizedLinear) and model.layers[0].qkv.weight.bits == bits
        assert model.layers[0].qkv.bias is not None  # qwen2's q/k/v bias survives quantization
        got, ref = logits(core, ids), logits(dense, ids)
        assert (got - ref).abs().max() < (0.05 if bits == 8 else 0.5) * ref.abs().max()


def test_quantization_needs_fast_precision():
    with pytest.raises(InvalidRequest, match="needs precision 'fast'"):
        EngineConfig(precision="exact", quantization="int4")
    with pytest.raises(InvalidRequest, match="quantization must be one of"):
        EngineConfig(quantization="fp8")


def test_prompt_gemm_setting_is_checked_and_reaches_the_engine_args():
    import argparse

    from tokenmill.entrypoints.engine_args import add_engine_args, engine_kwargs

    with pytest.raises(InvalidRequest, match="prompt_gemm must be one of") as err:
        EngineConfig(prompt_gemm="fp8")
    assert err.value.param == "prompt_gemm"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["prompt_gemm"] == "auto"
    assert EngineConfig(**engine_kwargs(parser.parse_args(["--prompt-gemm", "bf16"]))).prompt_gemm == "bf16"


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quants_run_from_their_blocks_or_as_bf16_with_a_warning(tmp_path, kind, caplog):
    # 10 matrices: embed, lm_head and 4 a layer (q/k/v and gate/up fused). Never re-quantized: with a kernel for the type the file's blocks run as they are, near the
    # file's size; without one (older kernels) the matrices run as bf16 and the log says so once.
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=256, intermediate_size=512)
    path = write_tiny_gguf(folder, tmp_path / "k.gguf", quant=kind)
    loaded = load_weights(str(path))
    assert loaded.gguf_types["model.layers.0.mlp.down_proj.weight"] == kind
    down = loaded.weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, GGUFWeight) and down.kind == kind
    with caplog.at_level("WARNING", logger="tokenmill.model.builder"):
        fast = build_engine_core(EngineConfig(model=str(path), precision="fast", num_threads=1, kv_cache_tokens=256))
    qkv = fast.runner.model.layers[0].qkv
    warnings = [r.getMessage() for r in caplog.records if "without a CPU kernel" in r.getMessage()]
    if kind in kernel_types():
        assert isinstance(qkv, QuantizedLinear) and kind in qkv.weight.kind and not warnings
        assert fast.runner.model.weight_bytes() <= 1.1 * os.path.getsize(path)
    else:
        assert isinstance(qkv, DenseLinear) and qkv.weight.dtype == torch.bfloat16
        assert len(warnings) == 1 and f"{kind} (10 matrices, no kernel)" in warnings[0] and "MB" in warnings[0]
    exact = build_engine_core(EngineConfig(model=str(path), precision="exact", num_threads=1, kv_cache_tokens=256))
    ids = list(range(100, 104))
    a, b = logits(fast, ids), logits(exact, ids)
    assert (a - b).abs().max() < 0.1 * b.abs().max()
