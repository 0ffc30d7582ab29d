"""The checks a server makes of a model path before it starts a process (model/preflight.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from tokenmill.errors import ModelLoadError
from tokenmill.model.default_model import default_model_path
from tokenmill.model.preflight import check_model_path


def write_gguf(path: Path, tokenizer: bool = True) -> Path:
    """A GGUF holding metadata only: all the checks read."""
    w = gguf.GGUFWriter(str(path), "llama")
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "c"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: p / "missing.gguf", "no such file or directory"),
        (lambda p: p, "not a GGUF file and not a folder with config.json"),  # a folder without config.json
        (lambda p: written(p / "zero.gguf", b""), "the file is empty"),
        (lambda p: written(p / "text.gguf", b"hello"), "not a GGUF file (starts with b'hell'"),
        (lambda p: write_gguf(p / "no-tok.gguf", tokenizer=False), "no 'tokenizer.ggml.model'"),
    ],
)
def test_what_is_plainly_not_a_model_is_named(tmp_path: Path, make, problem: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ModelLoadError, match="cannot load model from") as err:
        check_model_path(str(path))
    assert problem in err.value.problem


def test_metadata_cut_short_is_named(tmp_path: Path) -> None:
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF metadata"):
        check_model_path(str(cut))


def test_models_pass(tmp_path: Path) -> None:
    check_model_path(str(write_gguf(tmp_path / "ok.gguf")))
    check_model_path(default_model_path())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    check_model_path(str(tmp_path / "hf"))


def test_serve_refuses_a_bad_file_in_one_line_before_starting_anything(tmp_path: Path) -> None:
    (tmp_path / "zero.gguf").write_bytes(b"")
    done = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--model",
                           str(tmp_path / "zero.gguf")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: cannot load model from {tmp_path / 'zero.gguf'}: the file is empty"


def test_the_api_process_stays_torch_free() -> None:
    code = "import sys, tokenmill.model.preflight; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
