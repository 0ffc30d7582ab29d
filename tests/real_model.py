"""Shared fixtures for the end-to-end tests on the bundled SmolLM2-135M-Instruct GGUF.

Loading and dequantizing the GGUF takes seconds, so the weights are loaded once per session and
every LLM built by these tests reuses them (the engine under test is still built fresh each time).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import tokenmill.model.builder as builder
from tokenmill.entrypoints.llm import LLM
from tokenmill.model.default_model import default_model_path
from tokenmill.model.loader import load_weights

_cached_load = functools.lru_cache(maxsize=2)(load_weights)


def make_llm(**engine_args) -> LLM:
    engine_args.setdefault("num_threads", 2)
    # The end-to-end tests compare with transformers' fp32 output: exact unless a test says otherwise.
    engine_args.setdefault("precision", "exact")
    mp = pytest.MonkeyPatch()
    mp.setattr(builder, "load_weights", _cached_load)
    try:
        return LLM(**engine_args)
    finally:
        mp.undo()


@functools.lru_cache(maxsize=1)
def hf_model():
    from transformers import AutoModelForCausalLM

    from tests.transformers_gguf import shared_gguf_parsing

    path = default_model_path()
    with shared_gguf_parsing():
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    # ignore_eos means "do not stop at EOS", not "never sample EOS" (vLLM's meaning): with no EOS id
    # set, generate() neither stops nor masks it, whereas min_new_tokens would mask it.
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_tokenizer():
    """transformers' tokenizer of the bundled GGUF: one per test process (building it takes seconds)."""
    from tests.tiny_models import bundled_tokenizer

    return bundled_tokenizer()


def hf_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, EOS ignored (the reference every fidelity test uses)."""
    model = hf_model()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(prompt_ids):].tolist()
