"""Checks of a model path that need neither torch nor the weights, made before a server starts the
processes that load it.

Why: `serve` (and the model router, before it evicts a loaded model to make room) hands the path to
child processes; a path that is plainly not a model then failed seconds later, behind the tokenizer's
export, with a message about whatever failed first (a tokenizer backend, a process exit code). These
checks read at most the file's metadata, so the API process stays torch-free, and say what is wrong
in the loader's own words (ModelLoadError). What they cannot see (a truncated tensor table, an
architecture without a model class) the loader still reports, from the scheduler process.
"""

from __future__ import annotations

import os

from tokenmill.errors import ModelLoadError


def check_model_path(path: str) -> None:
    """Raises ModelLoadError naming the problem if `path` cannot be a model tokenmill loads: missing,
    a folder without config.json, an empty file, a file that is not GGUF, GGUF metadata that does not
    parse, or a GGUF without a tokenizer or an architecture."""
    if not os.path.exists(path):
        raise ModelLoadError(path, "no such file or directory")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(path, "not a GGUF file and not a folder with config.json")
        return
    # Here, not at the top: the API process imports this module (the model pool) and needs numpy
    # only once it checks a GGUF.
    from tokenmill.model.gguf_metadata import GGUF_MAGIC, read_gguf_metadata

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(path, f"cannot read file ({e.strerror})") from e
    if not magic:
        raise ModelLoadError(path, "the file is empty")
    if magic != GGUF_MAGIC:
        raise ModelLoadError(path, f"not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        meta = read_gguf_metadata(path)
    except Exception as e:  # struct, unicode, numpy: a header cut short or damaged
        raise ModelLoadError(path, f"corrupt or truncated GGUF metadata ({type(e).__name__}: {e})") from e
    for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if key not in meta:
            raise ModelLoadError(path, f"the GGUF metadata has no {key!r}")
