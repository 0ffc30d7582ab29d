"""`tokenmill bench make-low-bit` on a tiny shape: the file holds the asked type in every layer matrix,
Q8_0 embedding and output, the bundled model's vocabulary, finite weights (Q4_K: its d and dmin), and
(Q1_0) loads and generates in both precisions with the same greedy tokens."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.cli import main
from tokenmill.model.gguf_file import read_gguf


@pytest.mark.parametrize("kind", ["Q1_0", "Q2_0", "Q4_K"])
def test_writes_a_loadable_low_bit_llama(tmp_path, kind):
    out = tmp_path / f"{kind}.gguf"
    argv = ["bench", "make-low-bit", "--out", str(out), "--type", kind, "--hidden", "256", "--layers", "2",
            "--ff", "512", "--heads", "4", "--kv-heads", "2"]
    assert main(argv) == 0
    f = read_gguf(str(out))
    kinds = {t.name: t.kind for t in f.tensors}
    assert kinds["token_embd.weight"] == kinds["output.weight"] == "Q8_0"
    assert {k for n, k in kinds.items() if n.startswith("blk.") and n.endswith("_q.weight")} == {kind}
    assert kinds["blk.1.ffn_down.weight"] == kind and f.metadata["llama.block_count"] == 2
    assert f.metadata["tokenizer.ggml.tokens"] == 49152  # string arrays: their length
    assert "<|im_start|>" in f.metadata["tokenizer.chat_template"]
    if kind == "Q4_K":  # d and dmin are set: every weight finite, spread like an initialised model's
        reader = gguf.GGUFReader(str(out))
        t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert w.shape == (256, 256) and np.isfinite(w).all()
        assert 0.003 < w.std() < 0.03 and abs(w.mean()) < w.std()
    if kind != "Q1_0":
        return  # one file through the engine is enough (the kernels have their own tests)
    tokens = {}
    for precision in ("fast", "exact"):
        llm = LLM(str(out), precision=precision, num_threads=1, kv_cache_tokens=256)
        tokens[precision] = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
        llm.shutdown()
    assert len(tokens["exact"]) == 4 and tokens["fast"] == tokens["exact"]


def test_rows_that_are_not_whole_blocks_are_named(tmp_path, capsys):
    argv = ["bench", "make-low-bit", "--out", str(tmp_path / "x.gguf"), "--hidden", "192", "--layers", "1",
            "--ff", "256", "--heads", "3", "--kv-heads", "1"]
    assert main(argv) == 2
    assert "--hidden 192 is not a whole number of Q1_0 blocks of 128" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
