"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with a shared expert, Mixtral) as tiny random-weight
transformers models: logits equal transformers' in fp32, prompt and decode rows mixed; greedy output of
the engine token-identical to transformers alone, batched, chunked and preempted; the grouped expert
computation equals a per-token one; fast mode agrees with exact."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import MOE_ARCHS, make_tiny_model, reference_model
from tokenmill.entrypoints.llm import LLM
from tokenmill.model.loader import load_weights
from tokenmill.model.moe import MoEDecoderLayer
from tokenmill.model.registry import model_class
from tokenmill.model.runner import ModelRunner, SeqChunk
from tokenmill.sample.sampling_params import SamplingParams

ATOL = 1e-4
PROMPT = [17, 300, 4021, 99, 12000, 7, 7, 42, 31337, 500, 1024, 2048, 5, 6, 77, 48000, 3, 250, 9000, 11]
PROMPTS = [PROMPT, PROMPT[:7], [5, 6, 7, 8] * 9, [42] * 3]
NEW = 10


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_model(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    ref = reference_model(folder)
    greedy = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
            greedy.append(out[0, len(prompt):].tolist())
    return request.param, folder, ref, greedy


def test_logits_match_transformers(moe_model):
    arch, folder, ref, _ = moe_model
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    loaded = load_weights(str(folder))
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, max_positions=256)
    assert any(isinstance(layer, MoEDecoderLayer) for layer in model.layers)
    if arch == "qwen3_moe":  # mlp_only_layers=[1]: a dense layer after a sparse one
        assert [isinstance(layer, MoEDecoderLayer) for layer in model.layers] == [True, False]
    runner = ModelRunner(model, num_pages=32, page_size=4)
    whole = runner.execute([SeqChunk(PROMPT, 0, list(range(8)), sample=True)])
    torch.testing.assert_close(whole[0], expected[-1], atol=ATOL, rtol=0)
    other, third = list(range(8, 16)), list(range(16, 24))
    runner.execute([SeqChunk(PROMPT[:12], 0, other, sample=True)])
    for pos in range(12, len(PROMPT)):
        logits = runner.execute([SeqChunk([PROMPT[pos]], pos, other, sample=True),
                                 SeqChunk(PROMPT[:pos], 0, third, sample=True)])
        torch.testing.assert_close(logits[0], expected[pos], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], expected[pos - 1], atol=ATOL, rtol=0)


def test_grouped_experts_equal_a_per_token_loop(moe_model):
    _, folder, _, _ = moe_model
    loaded = load_weights(str(folder))
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, max_positions=64)
    block = next(layer for layer in model.layers if isinstance(layer, MoEDecoderLayer)).moe_block
    x = torch.randn(37, loaded.config.hidden_size)
    top_w, top_i = block.route(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for e in sorted(range(block.moe.top_k), key=lambda j: int(top_i[t, j])):  # ascending expert id
            acc = acc + block.experts[int(top_i[t, e])](x[t:t + 1])[0] * top_w[t, e]
        if block.shared is not None:
            acc = acc + torch.sigmoid(x[t] @ block.shared_gate[0]) * block.shared(x[t:t + 1])[0]
        rows.append(acc)
    torch.testing.assert_close(block(x), torch.stack(rows), atol=1e-5, rtol=0)


def llm(folder, **kw) -> LLM:
    return LLM(str(folder), precision="exact", num_threads=1, **kw)


def run(engine: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_greedy_equals_transformers_alone_batched_chunked_preempted(moe_model):
    _, folder, _, greedy = moe_model
    engine = llm(folder, kv_cache_tokens=1024)
    assert [run(engine, [p])[0] for p in PROMPTS] == greedy  # alone
    assert run(engine, PROMPTS) == greedy  # batched
    chunked = llm(folder, kv_cache_tokens=1024, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert run(chunked, PROMPTS) == greedy
    tight = llm(folder, kv_cache_tokens=48, page_size=4, enable_prefix_caching=False)  # preempts
    assert run(tight, PROMPTS) == greedy
    assert tight.stats()["num_preemptions"] > 0


def test_fast_mode_agrees_with_exact(moe_model):
    _, folder, _, greedy = moe_model
    fast = LLM(str(folder), precision="fast", num_threads=1, kv_cache_tokens=1024, quantization="int8")
    got = run(fast, PROMPTS)
    same = sum(a == b for g, e in zip(got, greedy) for a, b in zip(g, e))
    assert same >= 0.7 * NEW * len(PROMPTS), (got, greedy)
