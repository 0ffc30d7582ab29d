"""Exported tokenizers kept between runs, so a server that starts again on the same files skips the build.

Building a model's tokenizer (tokenizer_export.py) costs a child process that imports transformers and
torch and converts the vocabulary: ~10 s of CPU for the bundled model, most of `tokenmill serve`'s
start-up, paid again on every start and by every model the router loads. The result is one JSON file
that depends only on the model's tokenizer files and the code that builds it, so it is kept under
~/.cache/tokenmill/tokenizers ($TOKENMILL_CACHE_DIR/tokenizers, as the kernels are), named by a hash
of: the builder's format and source, the versions of transformers and tokenizers, and the path, size
and modification time of each file the tokenizer is read from. Any change to those is a new name (a
miss), never a stale hit. Only successful builds are kept; an entry that cannot be read is dropped and
the tokenizer built again. The newest `KEEP` entries stay. `TOKENMILL_TOKENIZER_CACHE=0` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import shutil
from pathlib import Path

from tokenmill.cache_root import cache_root

logger = logging.getLogger(__name__)

KEEP = 16  # entries: a few MB each (a 262k vocabulary ~20 MB)
# What a Hugging Face folder's tokenizer is read from (transformers reads no other file for it).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                      "config.json", "generation_config.json")
# The code that builds it: a change to any of these is a new key.
_BUILDERS = ("tokenizer_files.py", "tokenizer_export.py", "spm_vocab.py", "gguf_metadata.py")


def cache_dir() -> Path:
    return cache_root() / "tokenizers"


def enabled() -> bool:
    return os.environ.get("TOKENMILL_TOKENIZER_CACHE", "1") != "0"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _source_files(model: str) -> list[str]:
    if os.path.isdir(model):
        return [os.path.join(model, name) for name in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(model, name))]
    return [model] if os.path.isfile(model) else []


def key(model: str, format_version: int) -> str | None:
    """The entry's name for `model` (an absolute path); None where it has no files to key on, or the
    cache is off: then nothing is looked up or kept."""
    files = _source_files(model)
    if not files or not enabled():
        return None
    h = hashlib.sha256(f"format {format_version}\n".encode())
    for package in ("transformers", "tokenizers"):
        h.update(f"{package} {_version(package)}\n".encode())
    here = Path(__file__).parent
    for name in _BUILDERS:
        h.update((here / name).read_bytes())
    for path in files:
        st = os.stat(path)
        h.update(f"{os.path.realpath(path)} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def lookup(name: str | None) -> Path | None:
    """The kept export named `name` (key()), if there is one; its use time is refreshed."""
    entry = None if name is None else cache_dir() / f"{name}.json"
    if entry is None or not entry.is_file():
        return None
    with contextlib.suppress(OSError):
        os.utime(entry)  # the least recently used go first
    return entry


def store(name: str | None, exported: str) -> None:
    """Keep the successful export at `exported` as `name`; a cache that cannot be written is only a
    slower start."""
    if name is None:
        return
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{name}.{os.getpid()}.partial"
        shutil.copyfile(exported, partial)
        os.replace(partial, folder / f"{name}.json")
        entries = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("could not keep the tokenizer in %s: %s", folder, exc)


def drop(name: str | None) -> None:
    """Forget the entry `name` (it could not be read)."""
    if name is not None:
        (cache_dir() / f"{name}.json").unlink(missing_ok=True)
