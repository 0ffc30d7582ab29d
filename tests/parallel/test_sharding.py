"""Tensor-parallel sharding without processes: slices of quantized weights keep the file's numbers,
each rank's slices put back together give the whole weight, and sizes that don't divide are refused
with the sizes that would work."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny_model
from tokenmill.errors import InvalidRequest
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import load_weights
from tokenmill.model.quant import quantize_int4, quantize_int8
from tokenmill.parallel.sharding import TensorParallelShard, check_tensor_parallel_size, vocab_range

SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192)


@pytest.mark.parametrize("quantize", [quantize_int4, quantize_int8])
def test_quantized_slices_hold_exactly_the_whole_weights_numbers(quantize):
    w = quantize(torch.randn(48, 160))
    whole = w.dequantize()
    assert torch.equal(w.column_slice(32, 128).dequantize(), whole[:, 32:128])
    assert torch.equal(w.row_slice(16, 40).dequantize(), whole[16:40])
    with pytest.raises(ValueError, match="groups of 32"):
        w.column_slice(16, 64)


def test_sizes_that_do_not_divide_are_refused_naming_the_sizes_that_work():
    check_tensor_parallel_size(SMOLLM2, 3)
    with pytest.raises(InvalidRequest, match=r"attention heads \(9\), KV heads \(3\).*work for this model: 1, 3$"):
        check_tensor_parallel_size(SMOLLM2, 2)


def test_vocabulary_shares_cover_every_row_once():
    ranges = [vocab_range(10, r, 3) for r in range(3)]
    assert ranges == [(0, 4), (4, 8), (8, 10)]


class _Group:  # sharding reads only the rank and the size
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.world_size = rank, size


def test_each_ranks_slices_put_together_are_the_whole_weights(tmp_path):
    loaded = load_weights(str(make_tiny_model(tmp_path, "qwen2", tokenizer=False)))  # q/k/v biases too
    mc, weights = loaded.config, loaded.weights
    shards = [TensorParallelShard(_Group(r, 2)).shard_weights(mc, weights) for r in range(2)]
    layer = "model.layers.0."
    along_rows = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.bias",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight"]
    for name in along_rows:
        assert torch.equal(torch.cat([s[layer + name] for s in shards]), weights[layer + name]), name
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert torch.equal(torch.cat([s[layer + name] for s in shards], dim=1), weights[layer + name]), name
    assert torch.equal(torch.cat([s["model.embed_tokens.weight"] for s in shards]), weights["model.embed_tokens.weight"])
    assert shards[1][layer + "input_layernorm.weight"] is weights[layer + "input_layernorm.weight"]
    part = TensorParallelShard(_Group(1, 2)).shard_config(mc)
    assert (part.num_heads, part.num_kv_heads, part.intermediate_size) == (2, 1, 64)
    assert (part.head_dim, part.vocab_size) == (mc.head_dim, mc.vocab_size)


def test_serve_refuses_parallel_settings_that_cannot_work(capsys):
    from tokenmill.entrypoints.cli import main

    # Each data-parallel replica's TP group needs a port of its own.
    assert main(["serve", "--data-parallel-size", "2", "--tensor-parallel-size", "3", "--master-port", "1234"]) == 2
    assert "--master-port 0" in capsys.readouterr().err
    assert main(["serve", "--tensor-parallel-size", "3", "--nnodes", "2"]) == 2
    assert "multiple of nnodes" in capsys.readouterr().err
    assert main(["serve", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "2",
                 "--master-port", "1234"]) == 2
    assert "node_rank must be in [0, 2)" in capsys.readouterr().err


def test_gguf_blocks_are_sliced_whole_and_a_cut_block_falls_back_to_exact_values(tmp_path, caplog):
    from tests.tiny_models import write_tiny_gguf
    from tokenmill.model.quant_formats import GGUFWeight

    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=256, intermediate_size=512,
                             vocab_size=512, num_key_value_heads=4)
    mix = {"down_proj": "Q4_K", "o_proj": "Q5_0"}
    path = write_tiny_gguf(folder, tmp_path / "k.gguf",
                           quant=lambda name: next((k for p, k in mix.items() if p in name), "Q6_K"))
    loaded = load_weights(str(path))
    mc, weights = loaded.config, loaded.weights
    layer = "model.layers.0."
    down, o_proj, gate = (weights[layer + n] for n in ("mlp.down_proj.weight", "self_attn.o_proj.weight",
                                                         "mlp.gate_proj.weight"))
    # 2 ranks: down's 512 inputs split at 256 (one Q4_K block each side), gate's rows whole.
    shards = [TensorParallelShard(_Group(r, 2)).shard_weights(mc, weights) for r in range(2)]
    parts = [s[layer + "mlp.down_proj.weight"] for s in shards]
    assert all(isinstance(p, GGUFWeight) and p.kind == "Q4_K" for p in parts)
    assert torch.equal(torch.cat([p.dequantize() for p in parts], dim=1), down.dequantize())
    assert torch.equal(torch.cat([s[layer + "mlp.gate_proj.weight"].dequantize() for s in shards]), gate.dequantize())
    assert torch.equal(torch.cat([s[layer + "self_attn.o_proj.weight"].dequantize() for s in shards], dim=1),
                       o_proj.dequantize())
    # 4 ranks would cut each Q4_K block of down in two: that shard holds the exact values instead, and
    # the log names the sizes that keep the blocks whole; o_proj's Q5_0 blocks of 32 stay whole.
    with caplog.at_level("WARNING", logger="tokenmill.parallel.sharding"):
        shard = TensorParallelShard(_Group(1, 4)).shard_weights(mc, weights)
    assert torch.equal(shard[layer + "mlp.down_proj.weight"], down.dequantize()[:, 128:256])
    assert isinstance(shard[layer + "self_attn.o_proj.weight"], GGUFWeight)
    assert any("tensor-parallel size 4 cuts its Q4_K blocks of 256" in r.getMessage()
               and "whole: 1, 2" in r.getMessage() for r in caplog.records)
