"""With the prefix cache on, greedy output of the bundled model stays token-identical to the cache
off and to transformers, for prompts that hit 0%, part of and all of their prefix; and each request
reports exactly the prefix it shared: its whole cached pages and the part of a cached page that
continues them (copied into a page of its own)."""

from __future__ import annotations

import functools

import pytest

from tests.real_model import hf_greedy, hf_tokenizer, make_llm
from tests.test_fidelity import CHATS, TEXT_PROMPTS, cases
from tokenmill.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
PAGE = 16


@functools.lru_cache(maxsize=1)
def prompts_and_refs() -> dict[str, tuple[list[int], list[int] | None]]:
    """Named prompts, with transformers' greedy continuation for the engine-core fidelity prompts.

    The two derived prompts (a branch off the long prompt, a page-aligned cut of it) are checked
    against the cache-off engine only: they exist to exercise partial hits, not the model.
    """
    tok = hf_tokenizer()
    short = tok(TEXT_PROMPTS[0])["input_ids"]
    long_prompt = max((tok(p)["input_ids"] for p in TEXT_PROMPTS), key=len)
    ids = tok.apply_chat_template(CHATS[-1], add_generation_prompt=True, tokenize=True)
    chat = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return {
        "short": (short, reference(short)),
        "long": (long_prompt, reference(long_prompt)),
        "chat": (chat, reference(chat)),
        "branch": (long_prompt[:200] + short, None),  # shares 200 tokens with the long prompt
        "aligned": (long_prompt[:320], None),  # page-aligned: its last token is recomputed on a hit
    }


def reference(prompt: list[int]) -> list[int]:
    # test_fidelity's cases() holds references for these prompts when it already ran in this
    # session; otherwise these three from transformers cost a fraction of computing all cases.
    if cases.cache_info().currsize:
        for case_prompt, ref in cases():
            if case_prompt == prompt:
                return ref[:NEW_TOKENS]
    return hf_greedy(prompt, NEW_TOKENS)


def generate(engine, names: list[str]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Runs the named prompts together on an EngineCore; returns tokens and cached-token counts."""
    table = prompts_and_refs()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for name in names:
        engine.add_request(f"{name}-{engine.num_steps}", table[name][0], params)
    while engine.has_unfinished():
        for out in engine.step():
            name = out.request_id.rsplit("-", 1)[0]
            tokens.setdefault(name, []).extend(out.new_token_ids)
            cached[name] = out.num_cached_tokens
        engine.check_integrity()
    return tokens, cached


def test_greedy_output_is_the_same_with_and_without_the_prefix_cache():
    # One thread: on a shared 2-core machine, two threads of each of several processes thrash.
    # Built first, so that transformers' references run under the same setting.
    on = make_llm(kv_cache_tokens=4096, num_threads=1).engine
    off = make_llm(kv_cache_tokens=4096, num_threads=1, enable_prefix_caching=False).engine
    table = prompts_and_refs()
    refs = {name: ref for name, (_, ref) in table.items() if ref is not None}

    # Cold: nothing to hit.
    tokens, cached = generate(on, ["short", "long"])
    assert tokens == {n: refs[n] for n in ("short", "long")}
    assert cached == {"short": 0, "long": 0}

    # Warm: full hits (the last prompt token still computed; the cached prompt + output holds the
    # prompt's last partial page), a branch off the long prompt at token 200 (12 whole pages and 8
    # tokens of the 13th), an aligned prompt, and a prompt with nothing in common.
    names = ["long", "short", "branch", "aligned", "chat"]
    tokens, cached = generate(on, names)
    assert {n: tokens[n] for n in refs} == refs
    n_long, n_short = len(table["long"][0]), len(table["short"][0])
    assert n_short < PAGE and n_long % PAGE
    assert cached == {"long": n_long - 1, "short": n_short - 1, "branch": 200, "aligned": 319, "chat": 0}
    stats = on.stats()
    assert stats["prefix_cache_hit_tokens_total"] == sum(cached.values()) and stats["kv_pages_cached"] > 0
    assert stats["kv_pages_in_use"] == 0

    # The cache off computes everything and gets the same tokens.
    tokens_off, cached_off = generate(off, names)
    assert tokens_off == tokens and set(cached_off.values()) == {0}
    assert off.stats()["kv_pages_cached"] == 0
