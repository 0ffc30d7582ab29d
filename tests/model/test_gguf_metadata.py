"""A GGUF's metadata read alone, and copied alone (model/gguf_metadata.py): transformers builds a BPE
GGUF's tokenizer through gguf-py's reader, which refuses a file holding a tensor type it does not
know (a newer llama.cpp's Q2_0), so the tokenizer is built from a copy without the tensor table."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.tiny_models import bundled_gguf, bundled_tokenizer
from tokenmill.model.gguf_metadata import (
    read_gguf_metadata,
    read_gguf_metadata_and_parameters,
    write_metadata_only,
)


def with_q2_0_tensor(metadata_only: Path, out: Path) -> Path:
    """`metadata_only` (no tensors) plus one 64 x 64 tensor of ggml type 42 (Q2_0), as GGUF v3 lays it."""
    blob = metadata_only.read_bytes()
    name = b"blk.0.attn_q.weight"
    info = struct.pack("<Q", len(name)) + name + struct.pack("<I2Q", 2, 64, 64) + struct.pack("<IQ", 42, 0)
    head = blob[:8] + struct.pack("<Q", 1) + blob[16:] + info
    head += b"\0" * (-len(head) % 32)
    out.write_bytes(head + bytes(64 * 18))
    return out


def test_the_copy_holds_every_key_and_no_tensor(tmp_path):
    src = tmp_path / "src.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 0.0])
    writer.add_uint32("llama.block_count", 2)
    writer.add_tensor("w", np.zeros((2, 18), np.int8), raw_shape=(2, 64), raw_dtype=42)  # Q2_0
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"42\)? is not a valid GGMLQuantizationType"):
        gguf.GGUFReader(str(src))  # why the copy exists
    copy = tmp_path / "copy.gguf"
    write_metadata_only(str(src), str(copy))
    reader = gguf.GGUFReader(str(copy))
    assert len(reader.tensors) == 0
    ours, theirs = read_gguf_metadata(str(src)), read_gguf_metadata(str(copy))
    assert ours.keys() == theirs.keys() and ours["general.name"] == "tiny"
    assert ours["tokenizer.ggml.tokens"] == theirs["tokenizer.ggml.tokens"] == ["a", "b", "<s>"]
    assert np.array_equal(ours["tokenizer.ggml.scores"], theirs["tokenizer.ggml.scores"])
    with pytest.raises(ValueError, match="not a GGUF file"):
        write_metadata_only(__file__, str(tmp_path / "x.gguf"))


def test_the_parameter_count_is_every_tensors_elements_read_past_any_metadata(tmp_path):
    path = tmp_path / "count.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "<s>"])  # strings, numbers, a nested array
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 0.0])
    writer.add_key_value("x.nested", [[1, 2], [3]], gguf.GGUFValueType.ARRAY)
    writer.add_float32("x.eps", 1e-5)
    writer.add_tensor("a", np.zeros((3, 5), np.float32))
    writer.add_tensor("b", np.zeros(7, np.float32))
    writer.add_tensor("c", np.zeros((2, 18), np.int8), raw_shape=(2, 64), raw_dtype=42)  # a type gguf-py lacks
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta, parameters = read_gguf_metadata_and_parameters(str(path))
    assert parameters == 15 + 7 + 128
    assert meta.keys() == read_gguf_metadata(str(path)).keys() and meta["x.eps"] == pytest.approx(1e-5)


def test_a_bpe_tokenizer_builds_from_a_file_with_a_type_gguf_py_lacks(tmp_path):
    from tokenmill.model.tokenizer_files import _transformers_gguf_tokenizer

    directory, name = bundled_gguf()
    bundled = str(Path(directory) / name)
    meta = tmp_path / "meta.gguf"
    write_metadata_only(bundled, str(meta))
    path = with_q2_0_tensor(meta, tmp_path / "with-q2_0.gguf")
    with pytest.raises(ValueError, match=r"42\)? is not a valid"):
        gguf.GGUFReader(str(path))
    text = "The quick brown fox, 12 345 times: naïve café."
    assert _transformers_gguf_tokenizer(str(path))(text)["input_ids"] == bundled_tokenizer()(text)["input_ids"]
