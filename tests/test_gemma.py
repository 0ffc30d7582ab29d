"""Gemma 2 and Gemma 3 as tiny random-weight models (a sliding window of 8 tokens) give transformers'
fp32 logits and greedy tokens: prompts shorter and longer than the window, alone, batched, in
chunks, preempted and served from the prefix cache, from a Hugging Face folder and from GGUF; the
engine runs them with the hybrid KV cache (kvcache/kv_groups.py), whose sliding groups must really
give back the pages that leave the window."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import GEMMA_ARCHS, GEMMA_WINDOW, make_tiny_model, reference_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.entrypoints.llm import LLM
from tokenmill.model.builder import kv_layout_for
from tokenmill.model.loader import load_weights
from tokenmill.model.registry import model_class
from tokenmill.model.runner import ModelRunner, SeqChunk
from tokenmill.sample.sampling_params import SamplingParams

ATOL = 1e-4
PROMPT = [17, 300, 4021, 99, 12000, 7, 7, 42, 31337, 500, 1024, 2048, 5, 6, 77, 48000, 3, 250, 9000, 11, 64, 9]
assert len(PROMPT) > 2 * GEMMA_WINDOW
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=GEMMA_ARCHS)
def tiny(request, tmp_path_factory):
    """(arch, folder, transformers model) of one architecture, made once per module."""
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, folder, reference_model(folder)


def build(path, page_size: int = 4, hybrid: bool = False) -> ModelRunner:
    loaded = load_weights(str(path))
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, max_positions=256)
    layout = kv_layout_for(loaded.config) if hybrid else None
    return ModelRunner(model, num_pages=48, page_size=page_size, kv_layout=layout)


def test_config_reads_the_layer_pattern_and_the_gemma_fields(tiny):
    arch, folder, ref = tiny
    config = load_weights(str(folder)).config
    assert config.architecture == arch
    assert config.layer_types == tuple(ref.config.layer_types)
    assert config.sliding_window == GEMMA_WINDOW and config.head_dim == 32
    assert config.query_pre_attn_scalar == 24
    if arch == "gemma2":
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (2.0, 3.0)
    else:
        assert config.qk_norm and config.rope_local_theta == 10000.0 and config.rope_theta == 1e6
        assert config.rope_scaling["rope_type"] == "linear"


def test_logits_match_transformers_whole_decoded_and_chunked(tiny):
    _, folder, ref_model = tiny
    with torch.inference_mode():
        ref = ref_model(torch.tensor([PROMPT])).logits[0]
    runner = build(folder)
    # Whole prompt, every position's logits (positions past the window included).
    whole = runner.execute([SeqChunk(PROMPT, 0, list(range(8)), sample=True, all_logits=True)])
    torch.testing.assert_close(whole, ref, atol=ATOL, rtol=0)
    # A prefill of 5 (inside the window), then decode rows beside another sequence's prefill.
    other, third = list(range(8, 16)), list(range(16, 24))
    runner.execute([SeqChunk(PROMPT[:5], 0, other, sample=True)])
    for pos in range(5, len(PROMPT)):
        logits = runner.execute([SeqChunk([PROMPT[pos]], pos, other, sample=True),
                                 SeqChunk(PROMPT[:pos], 0, third, sample=True)])
        torch.testing.assert_close(logits[0], ref[pos], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], ref[pos - 1], atol=ATOL, rtol=0)
    # Chunks of 7 after cached context, each crossing the window's edge.
    pages = list(range(24, 32))
    for start in range(0, len(PROMPT), 7):
        chunk = PROMPT[start:start + 7]
        logits = runner.execute([SeqChunk(chunk, start, pages, sample=True, all_logits=True)])
        torch.testing.assert_close(logits, ref[start:start + len(chunk)], atol=ATOL, rtol=0)


def test_hybrid_runner_attends_each_group_through_its_own_pages(tiny):
    """Sliding layers read their group's pages only, and never a page wholly before their window:
    page 0, which stands in for the pages a group let go, is filled with NaN."""
    _, folder, ref_model = tiny
    with torch.inference_mode():
        ref = ref_model(torch.tensor([PROMPT])).logits[0]
    runner = build(folder, hybrid=True)
    layout = runner.kv_layout
    assert layout.is_hybrid and len(runner._kv_tensors) == layout.slots_per_page == 1  # 1 full layer
    runner.execute([SeqChunk([1], 0, [1], sample=True, window_pages=[[2], [3]])])  # zeroes the pool
    for k_cache, v_cache in runner._kv_tensors:
        k_cache[:, :4].fill_(float("nan"))
        v_cache[:, :4].fill_(float("nan"))
    full = list(range(4, 10))
    window = [list(range(10, 16)), list(range(16, 22))]
    for start in range(0, len(PROMPT), 5):  # chunks of 5 crossing the window's edge
        chunk = PROMPT[start:start + 5]
        first_needed = max(0, start - GEMMA_WINDOW + 1) // 4  # what the scheduler keeps (window_groups.py)
        held = [[None] * first_needed + pages[first_needed:] for pages in window]
        logits = runner.execute([SeqChunk(chunk, start, full, sample=True, all_logits=True, window_pages=held)])
        torch.testing.assert_close(logits, ref[start:start + len(chunk)], atol=ATOL, rtol=0)
    # Page 4 (positions 16-19) copied in every group serves as the original: what the scheduler does
    # for a prompt that continues a cached page part way (engine/prefix_admission.py `copy_tail`).
    for src, dst in [(full[4], 22), (window[0][4], 23), (window[1][4], 24)]:
        runner.copy_page(src, dst)
    first_needed = max(0, 18 - GEMMA_WINDOW + 1) // 4
    held = [[None] * first_needed + pages[first_needed:4] + [copy] + pages[5:] for pages, copy in zip(window, (23, 24))]
    logits = runner.execute([SeqChunk(PROMPT[18:], 18, full[:4] + [22] + full[5:], sample=True, all_logits=True,
                                      window_pages=held)])
    torch.testing.assert_close(logits, ref[18:], atol=ATOL, rtol=0)
    # Decode rows of two sequences at once, one of them far past the window.
    logits = runner.execute([SeqChunk([PROMPT[-1]], len(PROMPT) - 1, full, sample=True,
                                      window_pages=[[None] * 3 + pages[3:] for pages in window])])
    torch.testing.assert_close(logits[0], ref[-1], atol=ATOL, rtol=0)


def test_engine_frees_window_pages_and_matches_transformers(tiny):
    _, folder, ref_model = tiny
    prompt = PROMPT + PROMPT[:9]  # 31 tokens, ~4 windows
    ref = hf_greedy(ref_model, prompt)
    engine = build_engine_core(EngineConfig(model=str(folder), precision="exact", num_threads=2, page_size=4,
                                            max_num_batched_tokens=6, kv_cache_tokens=256))
    groups = engine.scheduler.num_groups
    assert groups == 3
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    out, most = [], [0] * groups
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
        engine.check_integrity()
        for r in engine.scheduler.running:  # pages it points at in each group, its own or the tree's
            held = [len(r.pages)] + [sum(p is not None for p in pages) for pages in r.window_pages]
            most = [max(m, n) for m, n in zip(most, held)]
    assert out == ref
    # A sliding group holds at most the window before a 6-token chunk plus the chunk (5 pages of 4
    # tokens), where the full group ends with the whole context (42 computed tokens: 11 pages).
    assert max(most[1:]) <= engine.scheduler.layout.window_pages(4, 6) == 5 and most[0] == 11
    stats = engine.stats()
    assert stats["kv_groups"] == groups and stats["kv_group_1_window"] == GEMMA_WINDOW
    assert [stats[f"kv_group_{g}_pages_in_use"] for g in range(groups)] == [0] * groups
    # Released: the tree keeps the whole context in group 0, two windows in each sliding group.
    assert stats["kv_group_0_pages_cached"] == 10 and 0 < stats["kv_group_1_pages_cached"] <= 6


def hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [PROMPT[:5], PROMPT, PROMPT[3:17], [PROMPT[-1]] * 3 + PROMPT[:9]]


def assert_greedy(llm: LLM, prompts: list[list[int]], refs: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == refs
    llm.check_integrity()


@pytest.mark.parametrize("engine_args", [
    pytest.param({}, id="batched"),
    pytest.param({"max_num_batched_tokens": 6}, id="chunked"),
    # 20 pages of 4 tokens in 3 KV groups: a request of 22 + 12 tokens holds up to 9 + 2 x 5 pages,
    # so two cannot run together and requests are preempted.
    pytest.param({"kv_cache_tokens": 80, "page_size": 4, "max_num_batched_tokens": 8}, id="preempted"),
])
def test_greedy_matches_transformers(tiny, engine_args):
    _, folder, ref_model = tiny
    refs = [hf_greedy(ref_model, p) for p in PROMPTS]
    llm = LLM(str(folder), precision="exact", num_threads=2, **{"page_size": 4, **engine_args})
    assert_greedy(llm, PROMPTS, refs)
    if "kv_cache_tokens" in engine_args:
        assert llm.stats()["num_preemptions"] > 0
    for prompt, ref in zip(PROMPTS, refs):  # alone, and served from the prefix cache the second time
        assert_greedy(llm, [prompt], [ref])
    assert llm.stats()["prefix_cache_hit_tokens_total"] > 0


def test_gguf_conversion_matches_transformers(tmp_path):
    """llama.cpp's layout: norms stored as 1 + w, its tensor names, the pattern and local theta in code."""
    for arch in GEMMA_ARCHS:
        # The GGUF pattern is llama.cpp's (every 6th / 2nd layer global), theta and scale its constants.
        overrides = {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 32}
        if arch == "gemma3":
            overrides["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        folder = make_tiny_model(tmp_path / arch, arch, tokenizer=False, **overrides)
        ref_model = reference_model(folder)
        with torch.inference_mode():
            ref = ref_model(torch.tensor([PROMPT])).logits[0]
        gguf = write_tiny_gguf(folder, tmp_path / f"{arch}.gguf")
        loaded = load_weights(str(gguf))
        assert loaded.config.layer_types == tuple(ref_model.config.layer_types)
        logits = build(gguf).execute([SeqChunk(PROMPT, 0, list(range(8)), sample=True, all_logits=True)])
        # The embeddings went through F16: close, not equal.
        torch.testing.assert_close(logits, ref, atol=2e-2, rtol=0)
