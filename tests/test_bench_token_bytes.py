"""bench/token_bytes.py: the weight bytes a batch-1 decode token reads from a GGUF file, and the read
rate `bench latency` puts them against, on small files written here."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tokenmill.bench.token_bytes import read_ceiling, token_weight_bytes

HIDDEN, VOCAB, FF, EXPERTS, USED = 64, 96, 32, 8, 2


def _write(path, tensors: dict[str, np.ndarray], experts: int = 0) -> str:
    import gguf

    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    writer.add_block_count(1)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(USED)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


def _f32(*shape: int) -> np.ndarray:
    return np.ones(shape, dtype=np.float32)


def test_untied_embedding_counts_one_row_and_the_lm_head_whole(tmp_path):
    embd, out, q, norm = _f32(VOCAB, HIDDEN), _f32(VOCAB, HIDDEN), _f32(HIDDEN, HIDDEN), _f32(HIDDEN)
    path = _write(tmp_path / "m.gguf", {"token_embd.weight": embd, "output.weight": out,
                                       "blk.0.attn_q.weight": q, "blk.0.attn_norm.weight": norm})
    assert token_weight_bytes(path) == HIDDEN * 4 + out.nbytes + q.nbytes + norm.nbytes


def test_tied_embedding_is_read_whole_as_the_lm_head(tmp_path):
    embd, q = _f32(VOCAB, HIDDEN), _f32(HIDDEN, HIDDEN).astype(np.float16)
    path = _write(tmp_path / "m.gguf", {"token_embd.weight": embd, "blk.0.attn_q.weight": q})
    assert token_weight_bytes(path) == embd.nbytes + q.nbytes


def test_merged_experts_count_at_the_tokens_share(tmp_path):
    gate, down, router = _f32(EXPERTS, FF, HIDDEN), _f32(EXPERTS, HIDDEN, FF), _f32(EXPERTS, HIDDEN)
    embd = _f32(VOCAB, HIDDEN)
    path = _write(tmp_path / "moe.gguf", {"token_embd.weight": embd, "blk.0.ffn_gate_exps.weight": gate,
                                         "blk.0.ffn_down_exps.weight": down, "blk.0.ffn_gate_inp.weight": router},
                  experts=EXPERTS)
    experts = (gate.nbytes + down.nbytes) * USED // EXPERTS
    assert token_weight_bytes(path) == embd.nbytes + experts + router.nbytes


def test_a_model_folder_has_no_figure(tmp_path):
    assert token_weight_bytes(os.fspath(tmp_path)) is None


def test_read_ceiling_is_a_positive_rate():
    rate = read_ceiling(1, 1 << 20, seconds=0.0)
    assert 0.1 < rate < 10_000  # GB/s: a real rate, not bytes/s or a division by nothing


@pytest.mark.parametrize("nbytes", [1, 3])
def test_read_ceiling_takes_a_buffer_smaller_than_a_float(nbytes):
    assert read_ceiling(1, nbytes, seconds=0.0) > 0
