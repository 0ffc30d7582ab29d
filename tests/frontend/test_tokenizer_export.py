"""The tokenizer handed from the export process to the server's text processes (model/tokenizer_export.py)
is the tokenizer the model's files define: same ids, special tokens, EOS/BOS and chat template; a
failed build hands over its reason."""

from __future__ import annotations

import os

import pytest

from tokenmill.errors import ModelLoadError
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.model import tokenizer_export
from tokenmill.model.tokenizer_files import load_tokenizer_files

TEXTS = [
    "Hello world",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "naïve café — 東京 🚀 ü",
    "<|im_start|>user\nHi<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def handed_over(smol_path: str, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = str(tmp_path_factory.mktemp("handoff") / tokenizer_export.HANDOFF_FILE)
    # main() is what the export process runs; in this process it reuses the cached load.
    assert tokenizer_export.main([smol_path, path]) == 0
    return Tokenizer.from_files(tokenizer_export.read(path, smol_path))


def test_the_handed_over_tokenizer_is_the_one_the_files_define(handed_over, smol_tokenizer):
    for text in TEXTS:
        for special in (True, False):
            assert handed_over.encode(text, special) == smol_tokenizer.encode(text, special)
    ids = smol_tokenizer.encode(TEXTS[2] + TEXTS[3])
    for skip in (True, False):
        assert handed_over.decode(ids, skip) == smol_tokenizer.decode(ids, skip)
    assert handed_over.vocab_size == smol_tokenizer.vocab_size
    assert handed_over.bos_token_id == smol_tokenizer.bos_token_id
    assert handed_over.eos_token_ids == smol_tokenizer.eos_token_ids and handed_over.eos_token_ids
    assert handed_over.chat_template == smol_tokenizer.chat_template
    assert handed_over.apply_chat_template(CHAT) == smol_tokenizer.apply_chat_template(CHAT)
    assert handed_over.backend.get_added_tokens_decoder() == smol_tokenizer.backend.get_added_tokens_decoder()


def test_a_failed_build_hands_over_its_reason(tmp_path):
    path = str(tmp_path / "tokenizer.json")
    missing = str(tmp_path / "no-such-model.gguf")
    # The real export process: it fails before it would import transformers, so this is quick.
    with pytest.raises(ModelLoadError, match="expected a .gguf file") as caught:
        tokenizer_export.export(missing, path)
    assert caught.value.path == missing
    # A detokenizer waiting for the file gets the same reason.
    with pytest.raises(ModelLoadError, match="expected a .gguf file"):
        tokenizer_export.wait_for(path, missing)


def test_wait_for_returns_once_the_file_is_there_and_stops_when_told(smol_path, tmp_path):
    path = str(tmp_path / "tokenizer.json")
    with pytest.raises(ModelLoadError, match="stopped waiting"):
        tokenizer_export.wait_for(path, smol_path, keep_waiting=lambda: False)
    assert not os.path.exists(path)
    calls = []

    def exporter_finishes() -> bool:  # the file appears while the reader waits
        calls.append(1)
        tokenizer_export.write(path, load_tokenizer_files(smol_path))
        return True

    files = tokenizer_export.wait_for(path, smol_path, keep_waiting=exporter_finishes)
    assert calls == [1] and files.eos_token_ids == load_tokenizer_files(smol_path).eos_token_ids
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".partial")]  # renamed into place
