"""The fused decode step (csrc/decode_step.cpp) over every GGUF block format, and over linears that mix
formats (Q4_K_M keeps q/k in Q4_K and v in Q6_K inside one fused q/k/v): the same logits and K/V as
the layers op by op, on each blocked kernel's kit (AVX512-VNNI, AVX2), in a step of 6 rows and in one
of 16 (where a CPU with AMX-INT8 runs the parts that fold on its tiles, csrc/quant_amx8.h, both ways).
The weights are random blocks swapped into a tiny model built in fast mode."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_block_decoders import random_blocks
from tests.model.test_fused_decode import decode_chunks, ids, prefill
from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model.fused_decode import FusedDecodeStack
from tokenmill.model.kernels import decode_step
from tokenmill.model.layers.factory import ConcatLinear
from tokenmill.model.layers.quantized_linear import QuantizedLinear
from tokenmill.model.quant import to_blocked_gguf
from tokenmill.model.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(not decode_step.available(), reason="needs the C++ kernels and a blocked kernel")

HIDDEN, INTER, HEADS, KV_HEADS = 256, 512, 4, 2
HEAD_DIM = HIDDEN // HEADS
# Per layer: the formats of q/k/v (as parts of one linear: (type, rows), ...), o, gate/up, down.
LAYERS = [
    ([("Q4_K", 384), ("Q6_K", 128)], [("Q5_0", HIDDEN)], [("Q5_K", 2 * INTER)], [("IQ4_XS", HIDDEN)]),
    ([("Q2_K", 256), ("Q3_K", 256)], [("Q5_1", HIDDEN)], [("IQ4_NL", INTER), ("Q8_0", INTER)], [("Q6_K", HIDDEN)]),
    ([("Q4_0", 512)], [("Q4_1", HIDDEN)], [("Q8_0", 2 * INTER)], [("Q4_K", HIDDEN)]),
    ([("Q1_0", 384), ("Q2_0", 128)], [("MXFP4", HIDDEN)], [("Q1_0", INTER), ("MXFP4", INTER)], [("Q2_0", HIDDEN)]),
]


def linear(parts: list[tuple[str, int]], k: int, seed: int):
    """A linear of random blocks (scales ~1e-3 so that activations stay of order one)."""
    layers = []
    for i, (kind, n) in enumerate(parts):
        raw = random_blocks(kind, n, k, seed=seed + i, scale=1e-3)
        layers.append(QuantizedLinear(to_blocked_gguf(kind, torch.from_numpy(raw), (n, k)), None))
    return layers[0] if len(layers) == 1 else ConcatLinear(layers, None)


@pytest.fixture
def mixed_runner(tmp_path, kernel):
    tmp = tmp_path
    folder = make_tiny_model(tmp, "llama", tokenizer=False, hidden_size=HIDDEN, intermediate_size=INTER,
                             num_hidden_layers=len(LAYERS), num_attention_heads=HEADS,
                             num_key_value_heads=KV_HEADS)
    gguf = write_tiny_gguf(folder, tmp / "tiny.gguf", quant="Q8_0")
    config = EngineConfig(model=str(gguf), precision="fast", num_threads=2, kv_cache_tokens=512)
    runner = build_engine_core(config).runner
    model = runner.model
    for i, (qkv, o, gate_up, down) in enumerate(LAYERS):
        layer = model.layers[i]
        layer.qkv = linear(qkv, HIDDEN, 100 * i)
        layer.o_proj = linear(o, HEADS * HEAD_DIM, 100 * i + 10)
        layer.gate_up = linear(gate_up, HIDDEN, 100 * i + 20)
        layer.down = linear(down, INTER, 100 * i + 30)
    model.fused_decode = FusedDecodeStack.supports(model)
    model._decode_stack = None
    return ModelRunner(model, runner.num_pages, runner.page_size, torch.bfloat16, prefill_as_decode_rows=True)


def sixteen_rows(prompts, pages) -> list[SeqChunk]:
    # four speculative runs of 4 tokens (last token + 3 drafts)
    return [SeqChunk(ids(4, 20 + i), len(p), pg, sample=True, num_logits=4) for i, (p, pg) in enumerate(zip(prompts, pages))]


@pytest.mark.parametrize("rows", [6, 16])
def test_every_format_and_mixed_linears_run_fused(mixed_runner, kernel, rows):
    runner = mixed_runner
    model = runner.model
    assert model.fused_decode, "every linear runs a blocked kernel, so the fused step takes them"
    prompts = [ids(37, 1), ids(21, 2), ids(50, 3), ids(29, 4)][: 3 if rows == 6 else 4]
    pages = prefill(runner, prompts)
    chunks = decode_chunks(prompts, pages) if rows == 6 else sixteen_rows(prompts, pages)
    assert sum(len(c.token_ids) for c in chunks) == rows
    model.fused_decode = True
    fused = runner.execute(chunks)
    assert model._decode_stack is not None and model._decode_stack.kit == decode_step.KITS[kernel]
    fused_kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    model.fused_decode = False
    eager = runner.execute(chunks)
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(fused, eager, atol=2e-4 * eager.abs().max().item(), rtol=1e-4)
    for (kf, vf), (ke, ve) in zip(fused_kv, runner.kv_caches):
        torch.testing.assert_close(kf.float(), ke.float(), atol=1e-4 * ke.float().abs().max().item(), rtol=1e-2)
        torch.testing.assert_close(vf.float(), ve.float(), atol=1e-4 * ve.float().abs().max().item(), rtol=1e-2)
