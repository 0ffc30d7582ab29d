"""The server's text processes never import torch (issue 21): the API process (whose `__main__` is
the CLI, which spawned tokenizer workers re-import), the detokenizer and the tokenizer workers handle
text and ids only, and torch costs each ~250 MB. Checked in a fresh interpreter, since this test
process has long imported torch: importing the entry modules, and the run-time path that used to pull
it in, building the tokenizer from the file the export process hands over (model/tokenizer_export.py).
The real server's processes are checked in tests/server/test_overload.py (the tokenizer workers test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.frontend.conftest import bundled_gguf_path
from tokenmill.model import tokenizer_export
from tokenmill.model.tokenizer_files import load_tokenizer_files

HEAVY = ("torch", "transformers", "xgrammar", "gguf", "numpy", "safetensors")

ENTRY_MODULES = (
    "tokenmill.entrypoints.cli",  # the API process's __main__ under `tokenmill serve`
    "tokenmill.entrypoints.openai.api_server",
    "tokenmill.frontend.detokenizer_process",
    "tokenmill.frontend.tokenize_pool",  # the tokenizer workers' own module
)


def heavy_modules_after(code: str) -> list[str]:
    script = f"import sys\n{code}\nprint(__import__('json').dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_text_processes_entry_modules_import_no_torch():
    imports = "\n".join(f"import {m}" for m in ENTRY_MODULES)
    # `tokenmill serve` parses its command line before it runs; the bench parsers import torch.
    parse = ("import contextlib, io\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
             "    tokenmill.entrypoints.cli.main(['serve', '--help'])")
    assert heavy_modules_after(imports + "\n" + parse) == []


def test_the_handed_over_tokenizer_loads_without_torch(tmp_path):
    smol_path = bundled_gguf_path()
    if smol_path is None:
        pytest.skip("the bundled SmolLM2 GGUF is not installed")
    path = str(tmp_path / tokenizer_export.HANDOFF_FILE)
    tokenizer_export.write(path, load_tokenizer_files(smol_path))
    code = (
        "from tokenmill.frontend.detokenizer_process import _load_tokenizer\n"
        f"tok = _load_tokenizer({path!r}, {smol_path!r})\n"
        "assert tok.decode(tok.encode('Hello world')) == 'Hello world'\n"
        "assert tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}])\n"
    )
    assert heavy_modules_after(code) == []
