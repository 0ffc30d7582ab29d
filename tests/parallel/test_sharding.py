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
        TensorParallelShard(_Group(0, 4)).shard_weights(mc, weights)  # rank 0 says it for all ranks
        shard = TensorParallelShard(_Group(1, 4)).shard_weights(mc, weights)
    assert torch.equal(shard[layer + "mlp.down_proj.weight"], down.dequantize()[:, 128:256])
    assert isinstance(shard[layer + "self_attn.o_proj.weight"], GGUFWeight)
    assert any("tensor-parallel size 4 cuts blocks of" in r.getMessage() and "Q4_K (blocks of 256)" in r.getMessage()
               and r.getMessage().endswith("whole: 1, 2") for r in caplog.records)


def test_cut_blocks_are_said_once_for_the_model_with_sizes_it_accepts(tmp_path, caplog):
    # Every layer's Q4_K down has 768 inputs (3 super-blocks): 2 ranks cut each in the middle of one.
    # Blocks would stay whole at 3 ranks, which the 4 heads / 2 KV heads refuse: only 1 is offered.
    from tests.tiny_models import write_tiny_gguf

    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=256, intermediate_size=768,
                             num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    path = write_tiny_gguf(folder, tmp_path / "cut.gguf", quant=lambda name: "Q4_K" if "down_proj" in name else "Q8_0")
    loaded = load_weights(str(path))
    with caplog.at_level("WARNING", logger="tokenmill.parallel.sharding"):
        shards = [TensorParallelShard(_Group(r, 2)) for r in range(2)]
        for shard in shards:
            shard.shard_weights(loaded.config, loaded.weights)
    lines = [r.getMessage() for r in caplog.records if "cuts blocks" in r.getMessage()]
    assert len(lines) == 1  # rank 0's, for all three layers
    assert "3 quantized matrices (3 Q4_K (blocks of 256)" in lines[0] and lines[0].endswith("whole: 1")
    for shard in shards:
        assert [c.name for c in shard.cuts] == [f"model.layers.{i}.mlp.down_proj.weight" for i in range(3)]
        # each shard: 256 x 384 inputs, 144 bytes a 256-weight block packed, fp32 dense
        assert all((c.file_bytes, c.resident_bytes) == (256 * 768 // 256 * 144 // 2, 256 * 384 * 4)
                   for c in shard.cuts)


def test_a_tensor_parallel_model_says_its_fallbacks_once_in_rank_zeros_log(tmp_path, caplog):
    # TQ2_0 has no kernel: every rank runs its shards of the up projections as bf16. One line for the
    # model (rank 0's, its shards' bytes), not one a rank.
    from tests.tiny_models import write_tiny_gguf
    from tokenmill.model.builder import build_model

    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2)
    path = write_tiny_gguf(folder, tmp_path / "tq.gguf", quant=lambda name: "TQ2_0" if "up_proj" in name else "Q8_0")
    lines = []
    for rank in (0, 1):
        caplog.clear()
        with caplog.at_level("WARNING", logger="tokenmill.model.builder"):
            build_model(str(path), "fast", "auto", 4, None, 4, 16, shard=TensorParallelShard(_Group(rank, 2)))
        lines.append([r.getMessage() for r in caplog.records if "without a CPU kernel" in r.getMessage()])
    assert lines[1] == [] and len(lines[0]) == 1
    assert "TQ2_0 (2 matrices, no kernel)" in lines[0][0]
    assert "of this rank's shards (each of the 2 tensor-parallel ranks alike)" in lines[0][0]
