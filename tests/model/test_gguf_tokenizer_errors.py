"""A GGUF whose tokenizer keys are missing is refused naming the key as the file spells it
(model/tokenizer_files.py), not as a bare KeyError of transformers' own name for it ('tokens')."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tokenmill.errors import ModelLoadError
from tokenmill.model.tokenizer_files import load_tokenizer_files


def write_gguf(path: Path, model: str | None, tokens: bool) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    if model is not None:
        w.add_tokenizer_model(model)
    if tokens:
        w.add_token_list(["a", "b", "c"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize(("model", "tokens", "key"), [
    ("gpt2", False, "tokenizer.ggml.tokens"),
    (None, True, "tokenizer.ggml.model"),
    ("llama", False, "tokenizer.ggml.tokens"),
    ("gpt2", True, "tokenizer.ggml.scores"),  # found missing by transformers, which says 'scores'
])
def test_a_missing_tokenizer_key_is_named(tmp_path: Path, model: str | None, tokens: bool, key: str) -> None:
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer_files(write_gguf(tmp_path / "m.gguf", model, tokens))
    assert err.value.problem == f"cannot build the tokenizer: the GGUF metadata has no '{key}'"
