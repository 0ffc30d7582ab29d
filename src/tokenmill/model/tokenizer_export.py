"""The tokenizer a model's files define, built once in a short-lived process and handed to the
server's text processes as one JSON file.

Building it needs transformers (tokenizer_files.py: so the ids match Hugging Face's), and transformers
5 imports torch on `import transformers` whenever torch is installed, with no switch to stop it. The
server's API process, its detokenizer and its tokenizer workers handle text and ids only, and torch
would cost each of them ~250 MB (docs/benchmarks.md, "Server memory: torch only in the scheduler").
So `tokenmill serve` builds the tokenizer in a child that exits once it has written the file
(`python -m tokenmill.model.tokenizer_export MODEL OUT`), and the text processes read the file with
the `tokenizers` package alone. It is the same tokenizer: `tokenizers` serializes its whole state
(vocabulary, merges, added tokens, normalizer, pre-tokenizer, post-processor, decoder), the form it
also pickles in. A build that fails writes its error instead, so whoever waits for the file learns why.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import tokenizers

from tokenmill.errors import ModelLoadError
from tokenmill.model import tokenizer_cache
from tokenmill.model.tokenizer_files import (
    TokenizerFiles,
    load_tokenizer_files,
    remember,
    sentencepiece_files,
)

logger = logging.getLogger(__name__)

FORMAT = 1
HANDOFF_FILE = "tokenizer.json"  # its name in the server's IPC directory
_WAIT_POLL_S = 0.05


def handoff_path(directory: str) -> str:
    """Where `tokenmill serve` puts the exported tokenizer: in its IPC directory, removed with it."""
    return os.path.join(directory, HANDOFF_FILE)


def write(path: str, files: TokenizerFiles | None, error: str | None = None) -> None:
    """The file, or the build's error; atomic (renamed into place), so a reader never sees half of it."""
    if files is None:
        body: dict = {"format": FORMAT, "error": error or "unknown error"}
    else:
        body = {
            "format": FORMAT,
            "tokenizer": files.backend.to_str(),
            "bos_token_id": files.bos_token_id,
            "eos_token_ids": sorted(files.eos_token_ids),
            "eos_token": files.eos_token,
            "chat_template": files.chat_template,
            "named_chat_templates": dict(files.named_chat_templates),
        }
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(body, f)
    os.replace(partial, path)


def read(path: str, model: str = "") -> TokenizerFiles:
    """The tokenizer in the file `write` made; raises ModelLoadError (naming `model`) if it holds an error."""
    with open(path, encoding="utf-8") as f:
        body = json.load(f)
    if body.get("format") != FORMAT:
        raise ModelLoadError(model or path, f"tokenizer file {path} has format {body.get('format')!r}, not {FORMAT}")
    if "error" in body:
        raise ModelLoadError(model or path, body["error"])
    return TokenizerFiles(
        tokenizers.Tokenizer.from_str(body["tokenizer"]),
        bos_token_id=body["bos_token_id"],
        eos_token_ids=frozenset(body["eos_token_ids"]),
        eos_token=body["eos_token"],
        chat_template=body["chat_template"],
        named_chat_templates=body["named_chat_templates"],
    )


def export(model: str, path: str, niceness: int = 0) -> TokenizerFiles:
    """Build the tokenizer of `model` (absolute path) in a child process, write it to `path`, read it
    back. Blocks for the child's seconds (transformers' import and the build): call it off the loop.
    niceness > 0: the child runs under `nice -n` (a model loading while others serve). A build kept
    from an earlier run on the same files (tokenizer_cache.py) is handed over instead."""
    name = tokenizer_cache.key(model, FORMAT)
    kept = tokenizer_cache.lookup(name)
    if kept is not None:
        try:
            files = read(str(kept), model)
        except Exception as exc:  # truncated, not JSON, not a tokenizer: build it again
            logger.warning("the kept tokenizer %s cannot be read (%s); building it again", kept, exc)
            tokenizer_cache.drop(name)
        else:
            # A failure here is the destination's (its folder removed by a server that gave up): the
            # kept build is fine and stays.
            partial = f"{path}.{os.getpid()}.partial"
            shutil.copyfile(kept, partial)
            os.replace(partial, path)  # atomic: the detokenizers wait for this name
            return files
    cmd = [sys.executable, "-m", __name__, model, path]
    nice = shutil.which("nice") if niceness else None
    # stderr is inherited: the build's own warnings belong in the server's log.
    proc = subprocess.run([nice, "-n", str(niceness), *cmd] if nice else cmd, stdin=subprocess.DEVNULL, check=False)
    if not os.path.exists(path):  # the child died before it could write even its error
        write(path, None, f"the tokenizer export process exited with {proc.returncode}")
    files = read(path, model)  # raises the build's error: nothing is kept
    tokenizer_cache.store(name, path)
    return files


def load(model: str) -> TokenizerFiles:
    """The tokenizer of `model` (absolute path) for a process that keeps transformers out: the offline
    `LLM`, as the server's text processes do. transformers' import is ~20 MB beside torch, and its GGUF
    conversion leaves ~50 MB more resident for the process's whole life (docs/benchmarks.md, "Resident
    memory of LLM(file) without transformers"); read from the export child's file (or the cache) the
    tokenizer costs only itself. Where transformers is already imported (a test, a caller that uses
    it), the build runs here instead: the import is paid, and the child would only add its seconds.
    Raises ModelLoadError with the build's error, as `tokenmill serve` does."""
    if "transformers" in sys.modules:
        return load_tokenizer_files(model)
    # A SentencePiece GGUF (Gemma) needs no transformers: built here, ~1 s more CPU than reading the
    # kept file, but ~190 MB less peak than parsing its 21 MB of JSON (docs/benchmarks.md).
    files = sentencepiece_files(model)
    if files is None:
        with tempfile.TemporaryDirectory(prefix="tokenmill-tokenizer-") as directory:
            files = export(model, handoff_path(directory))
    remember(model, files)  # the grammar backend's load_tokenizer_files gets this one, not a second build
    return files


def wait_for(path: str, model: str = "", keep_waiting: Callable[[], bool] = lambda: True) -> TokenizerFiles:
    """The tokenizer another process is exporting to `path`, once it is there (a detokenizer starts
    beside the export, not after it); stops with ModelLoadError when keep_waiting() turns False."""
    while not os.path.exists(path):
        if not keep_waiting():
            raise ModelLoadError(model or path, f"stopped waiting for the tokenizer file {path}")
        time.sleep(_WAIT_POLL_S)
    return read(path, model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a model's tokenizer and write it for tokenmill's text processes")
    parser.add_argument("model", help="absolute path of a .gguf file or a Hugging Face model folder")
    parser.add_argument("out", help="the JSON file to write (the tokenizer, or the error)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s tokenizer-export[%(process)d] %(name)s: %(message)s")
    try:
        files = load_tokenizer_files(args.model)
    except ModelLoadError as exc:
        write(args.out, None, exc.problem)
        return 1
    except Exception as exc:  # the reader needs the cause either way, and this process ends here
        logger.exception("building the tokenizer of %s failed", args.model)
        write(args.out, None, f"{type(exc).__name__}: {exc}")
        return 1
    if not os.path.isdir(os.path.dirname(args.out)):  # the server stopped waiting and cleaned up: no reader
        return 1
    write(args.out, files)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
