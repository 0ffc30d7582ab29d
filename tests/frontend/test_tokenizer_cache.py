"""The exported tokenizer is kept between runs (model/tokenizer_cache.py): a second export of the same
files is handed over without building, any change to the files is a miss, an unreadable entry is built
again, failures are never kept, and only the newest entries stay."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from tokenmill.errors import ModelLoadError
from tokenmill.model import tokenizer_cache, tokenizer_export
from tokenmill.model.tokenizer_export import FORMAT


@pytest.fixture
def builds(monkeypatch, tmp_path) -> list[list[str]]:
    """Each export's build, run in this process (main() is what the child runs; the load is cached)."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENMILL_TOKENIZER_CACHE", raising=False)
    calls: list[list[str]] = []

    def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, tokenizer_export.main(cmd[-2:]))

    monkeypatch.setattr(tokenizer_export.subprocess, "run", run)
    return calls


def entries() -> list[str]:
    folder = tokenizer_cache.cache_dir()
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def test_a_second_export_is_handed_over_from_the_cache(smol_path, tmp_path, builds):
    first = tokenizer_export.export(smol_path, str(tmp_path / "a.json"))
    assert len(builds) == 1 and len(entries()) == 1
    second = tokenizer_export.export(smol_path, str(tmp_path / "b.json"))
    assert len(builds) == 1  # no child this time
    assert (tmp_path / "b.json").read_bytes() == (tmp_path / "a.json").read_bytes()  # what detokenizers read
    assert second.backend.to_str() == first.backend.to_str()
    assert (second.eos_token_ids, second.bos_token_id, second.chat_template) == (
        first.eos_token_ids, first.bos_token_id, first.chat_template)


def test_an_unreadable_entry_is_built_again(smol_path, tmp_path, builds, caplog):
    tokenizer_export.export(smol_path, str(tmp_path / "a.json"))
    kept = tokenizer_cache.cache_dir() / entries()[0]
    kept.write_text(kept.read_text()[:1000])  # truncated
    with caplog.at_level(logging.WARNING, logger="tokenmill.model.tokenizer_export"):
        files = tokenizer_export.export(smol_path, str(tmp_path / "b.json"))
    assert len(builds) == 2 and "cannot be read" in caplog.text
    assert files.backend.get_vocab_size() == 49152
    assert tokenizer_export.read(str(kept), smol_path).backend.get_vocab_size() == 49152  # kept again, whole


def test_failed_builds_are_never_kept(tmp_path, builds):
    missing = str(tmp_path / "no-such-model.gguf")
    for _ in range(2):
        with pytest.raises(ModelLoadError, match="expected a .gguf file"):
            tokenizer_export.export(missing, str(tmp_path / "t.json"))
        os.unlink(tmp_path / "t.json")
    assert len(builds) == 2 and entries() == []


def test_the_cache_can_be_turned_off(smol_path, tmp_path, builds, monkeypatch):
    monkeypatch.setenv("TOKENMILL_TOKENIZER_CACHE", "0")
    tokenizer_export.export(smol_path, str(tmp_path / "a.json"))
    tokenizer_export.export(smol_path, str(tmp_path / "b.json"))
    assert len(builds) == 2 and entries() == []


def test_the_key_follows_the_files_the_tokenizer_is_read_from(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    key = tokenizer_cache.key(str(gguf), FORMAT)
    assert key == tokenizer_cache.key(str(gguf), FORMAT)
    assert tokenizer_cache.key(str(gguf), FORMAT + 1) != key
    os.utime(gguf, ns=(1, 1))
    touched = tokenizer_cache.key(str(gguf), FORMAT)
    assert touched != key
    gguf.write_bytes(b"GGUF" + bytes(61))
    os.utime(gguf, ns=(1, 1))
    assert tokenizer_cache.key(str(gguf), FORMAT) != touched  # same time, another size

    folder = tmp_path / "hf"
    folder.mkdir()
    assert tokenizer_cache.key(str(folder), FORMAT) is None  # nothing to key on: never cached
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    key = tokenizer_cache.key(str(folder), FORMAT)
    (folder / "model.safetensors").write_bytes(bytes(8))  # weights are not the tokenizer
    assert tokenizer_cache.key(str(folder), FORMAT) == key
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert tokenizer_cache.key(str(folder), FORMAT) != key


def test_only_the_newest_entries_stay(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_cache, "KEEP", 2)
    exported = tmp_path / "export.json"
    exported.write_text("{}")
    models = []
    for i in range(3):
        model = tmp_path / f"m{i}.gguf"
        model.write_bytes(bytes(i + 1))
        models.append(str(model))
        tokenizer_cache.store(tokenizer_cache.key(str(model), FORMAT), str(exported))
        os.utime(tokenizer_cache.cache_dir() / f"{tokenizer_cache.key(str(model), FORMAT)}.json", (i, i))
    assert len(entries()) == 2
    assert tokenizer_cache.lookup(tokenizer_cache.key(models[0], FORMAT)) is None  # the oldest went
    assert tokenizer_cache.lookup(tokenizer_cache.key(models[2], FORMAT)) is not None
