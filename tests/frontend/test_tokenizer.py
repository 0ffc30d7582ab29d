"""Tokenizer loading (GGUF and Hugging Face folder) and its ids against transformers'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from tokenmill.errors import ModelLoadError
from tokenmill.frontend.tokenizer import Tokenizer

TEXTS = [
    "hello world",
    " leading space",
    "你好，世界 🙂👍🏽",
    "e\u0301 combining",
    "<|im_start|>user\nhi",
    "",
    "a\n\n\tb",
]


def test_gguf_facts(smol_tokenizer: Tokenizer) -> None:
    assert smol_tokenizer.vocab_size == 49152
    assert (smol_tokenizer.bos_token_id, smol_tokenizer.bos_token) == (1, "<|im_start|>")
    assert (smol_tokenizer.eos_token_ids, smol_tokenizer.eos_token) == (frozenset({2}), "<|im_end|>")
    assert smol_tokenizer.all_special_ids == frozenset(range(17))
    assert smol_tokenizer.chat_template is not None and "<|im_start|>" in smol_tokenizer.chat_template
    assert isinstance(smol_tokenizer.backend, tokenizers.Tokenizer)


def test_loading_is_cached(smol_path: str, smol_tokenizer: Tokenizer) -> None:
    assert Tokenizer.from_model_path(smol_path) is smol_tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(smol_tokenizer: Tokenizer, hf_smol_tokenizer: Any, text: str) -> None:
    # SmolLM2's GGUF says add_bos_token = False: no BOS, exactly like transformers.
    assert smol_tokenizer.encode(text) == hf_smol_tokenizer(text)["input_ids"]
    assert (
        smol_tokenizer.encode(text, add_special_tokens=False)
        == hf_smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    )


def test_decode_matches_transformers(smol_tokenizer: Tokenizer, hf_smol_tokenizer: Any) -> None:
    ids = [1, *smol_tokenizer.encode("hi 你好"), 2, 3]
    for skip in (True, False):
        assert smol_tokenizer.decode(ids, skip) == hf_smol_tokenizer.decode(ids, skip_special_tokens=skip)
    assert smol_tokenizer.decode(ids) == "hi 你好"


def _write_hf_folder(folder: Path, smol: Tokenizer, *, jinja: str | None = None) -> None:
    folder.mkdir()
    (folder / "tokenizer.json").write_text(smol.backend.to_str())
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)


def test_hf_folder(tmp_path: Path, smol_tokenizer: Tokenizer) -> None:
    _write_hf_folder(tmp_path / "m", smol_tokenizer)
    tok = Tokenizer.from_model_path(str(tmp_path / "m"))
    assert tok.encode("hello world") == smol_tokenizer.encode("hello world")
    assert (tok.bos_token_id, tok.eos_token) == (1, "<|im_end|>")
    assert tok.eos_token_ids == frozenset({0, 2})  # tokenizer_config plus generation_config
    text = tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert text == "<|im_start|>user: hi\n"


def test_hf_folder_prefers_chat_template_jinja(tmp_path: Path, smol_tokenizer: Tokenizer) -> None:
    _write_hf_folder(tmp_path / "m", smol_tokenizer, jinja="{{ messages[0].content | upper }}")
    tok = Tokenizer.from_model_path(str(tmp_path / "m"))
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "HI"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == smol_tokenizer.encode("HI")


def test_bad_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        Tokenizer.from_model_path(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError):
        Tokenizer.from_model_path(str(tmp_path / "empty"))
