"""Greedy output of the bundled model must be token-identical to transformers in exact fp32 mode:
alone, all together, under chunked prefill, and under preemption."""

from __future__ import annotations

import functools

import pytest

from tests.real_model import hf_greedy, hf_tokenizer, make_llm
from tokenmill.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 16

TEXT_PROMPTS = [
    "The history of the printing press begins",
    "请用中文介绍一下长城的历史。",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "My favourite emojis are 🎉🚀🐍 and they mean",
    # Over 500 tokens: long enough to need several prefill chunks under a small budget.
    " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(45)) + " In summary,",
    "1, 1, 2, 3, 5, 8, 13,",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colours."},
        {"role": "assistant", "content": "Red, yellow, blue."},
        {"role": "user", "content": "And secondary ones?"},
    ],
]


@functools.lru_cache(maxsize=1)
def prompt_ids() -> list[list[int]]:
    """Every fidelity prompt as transformers tokenizes it (chats through its chat template)."""
    tok = hf_tokenizer()
    prompts = [tok(p)["input_ids"] for p in TEXT_PROMPTS]
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert max(len(p) for p in prompts) > 500
    return prompts


@functools.lru_cache(maxsize=1)
def cases() -> list[tuple[list[int], list[int]]]:
    """(prompt ids, transformers' greedy continuation) for every fidelity prompt."""
    return [(p, hf_greedy(p, NEW_TOKENS)) for p in prompt_ids()]


def greedy_params(new_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)


def assert_all_match(llm, prompts_and_refs, new_tokens: int = NEW_TOKENS):
    """Greedy output equals transformers' first `new_tokens` tokens (a greedy continuation's prefix is
    the shorter run's whole output), then the engine is idle with no page held."""
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in prompts_and_refs], greedy_params(new_tokens))
    for out, (_, ref) in zip(outs, prompts_and_refs):
        assert out.outputs[0].token_ids == ref[:new_tokens]
        assert out.outputs[0].finish_reason == "length"
    llm.check_integrity()
    assert llm.stats()["kv_pages_in_use"] == 0


def test_prompt_ids_equal_transformers_tokenization_and_chat_template():
    llm = make_llm(kv_cache_tokens=4096)
    tok = hf_tokenizer()
    for text in TEXT_PROMPTS:
        assert llm.tokenizer.encode(text) == tok(text)["input_ids"]
    for chat, (ids, _) in zip(CHATS, cases()[len(TEXT_PROMPTS):]):
        assert llm.chat_prompt_ids(chat) == ids


def test_each_prompt_alone():
    # One row a step: a short English prompt, the Chinese one (multi-byte pieces), the long one and
    # the multi-turn chat. Every prompt runs batched in the tests below.
    llm = make_llm(kv_cache_tokens=4096)
    for i in (0, 1, 4, 7):
        assert_all_match(llm, [cases()[i]])


def test_all_prompts_together():
    llm = make_llm(kv_cache_tokens=8192)
    assert_all_match(llm, cases())


def test_chunked_prefill_with_a_small_token_budget():
    llm = make_llm(kv_cache_tokens=8192, max_num_batched_tokens=96)
    assert_all_match(llm, cases())


def test_preemption_and_recompute_with_a_small_kv_pool():
    # 768 tokens of KV: the long prompt and its output alone nearly fill it, so requests must be
    # preempted and recomputed.
    llm = make_llm(kv_cache_tokens=768, page_size=16, max_num_batched_tokens=256)
    assert_all_match(llm, cases())
    assert llm.stats()["num_preemptions"] > 0
