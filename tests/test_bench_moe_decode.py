"""`tokenmill bench moe-decode` on a tiny MoE GGUF: the step timing runs the fused stack and reports
its share of each step."""

from __future__ import annotations

import pytest

from tests.moe_gguf import write_moe_gguf
from tests.tiny_models import make_tiny_model
from tokenmill.bench.moe_decode import measure_decode
from tokenmill.model.kernels import decode_step

SIZES = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_local_experts": 8}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_bench")
    folder = make_tiny_model(tmp, "mixtral", tokenizer=False, **SIZES)
    return str(write_moe_gguf(folder, tmp / "moe.gguf", lambda name: "Q4_K")[0])


@pytest.mark.skipif(not decode_step.available(), reason="needs the C++ kernels and AVX512-VNNI")
def test_decode_rounds_time_the_fused_stack(tiny_moe):
    rounds = measure_decode(tiny_moe, threads=1, steps=3, rounds=2)
    assert len(rounds) == 2
    for r in rounds:
        assert r["wall_ms"] > 0 and r["cpu_ms"] > 0 and r["tok_s"] > 0
        assert 0 < r["stack_wall_ms"] <= r["wall_ms"]  # every step ran the fused stack

