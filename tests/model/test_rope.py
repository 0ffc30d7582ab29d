"""RoPE tables are filled as positions are looked up (issue 23's resident memory: Gemma 3 270M's two
RoPEs over 32,768 positions were 128 MiB from the load): the same cos / sin bits as transformers'
per-forward computation however far the tables are filled, and a clear error past the context."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from tokenmill.model.config import ModelConfig
from tokenmill.model.rope import RotaryEmbedding

CONTEXT = 20_000  # not a multiple of the fill step: the last fill stops at the context
HEAD_DIM = 256


def config(theta: float) -> ModelConfig:
    return ModelConfig(architecture="gemma3", vocab_size=32, hidden_size=640, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=1, head_dim=HEAD_DIM, max_position_embeddings=CONTEXT,
                       rope_theta=theta)


@pytest.fixture(scope="module")
def reference():
    """transformers' Gemma 3 rotary embedding: theta 1e6 on full layers, 10,000 on sliding ones."""
    hf = Gemma3TextConfig(head_dim=HEAD_DIM, hidden_size=640, num_attention_heads=4, num_key_value_heads=1,
                          num_hidden_layers=2, max_position_embeddings=CONTEXT,
                          layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    return Gemma3RotaryEmbedding(hf)


@pytest.mark.parametrize("theta,layer_type", [(1e6, "full_attention"), (10000.0, "sliding_attention")])
def test_tables_fill_on_demand_with_transformers_bits(reference, theta, layer_type):
    rope = RotaryEmbedding(config(theta), CONTEXT)
    assert rope.filled == RotaryEmbedding.FILL_POSITIONS  # not the whole context at start-up
    # one position (a batch-1 decode step: views of the tables) fills on demand too
    batches = [torch.arange(0, 40), torch.tensor([4095, 4096, 9000, 5]), torch.arange(12_000, 12_512),
               torch.tensor([12_700]), torch.tensor([CONTEXT - 1, 0])]
    filled = []
    for positions in batches:
        cos, sin = rope.lookup(positions)
        filled.append(rope.filled)
        ref_cos, ref_sin = reference(torch.empty(0), positions[None], layer_type)
        # Bit for bit: exact mode's token identity with transformers rests on it.
        assert torch.equal(cos.squeeze(1), ref_cos[0]) and torch.equal(sin.squeeze(1), ref_sin[0])
        assert cos.shape == sin.shape == (len(positions), 1, HEAD_DIM) and cos.is_contiguous()
    assert filled == [4096, 12_288, 16_384, 16_384, CONTEXT]  # whole fill steps, the last one cut at the context
    every = torch.arange(CONTEXT)
    ref_cos, ref_sin = reference(torch.empty(0), every[None], layer_type)
    assert torch.equal(rope.cos, ref_cos[0]) and torch.equal(rope.sin, ref_sin[0])


def test_small_context_and_positions_past_it():
    rope = RotaryEmbedding(config(1e6), 100)
    assert rope.filled == 100 and rope.cos.shape == (100, HEAD_DIM)
    rope.lookup(torch.tensor([99]))
    with pytest.raises(ValueError, match="position 100 is past the context length of 100"):
        rope.lookup(torch.tensor([3, 100]))
    with pytest.raises(ValueError, match="position 100 is past the context length of 100"):
        rope.lookup(torch.tensor([100]))
    empty_cos, _ = rope.lookup(torch.tensor([], dtype=torch.long))
    assert empty_cos.shape == (0, 1, HEAD_DIM)
