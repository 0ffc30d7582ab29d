"""Mixture-of-experts layers in the fused decode step (csrc/decode_step_moe.h): the same logits as the
layers op by op (model/moe.py's fast path) to float rounding, for plain decode rows and a speculative
run, with and without a shared expert, on each blocked kernel's kit; a model the step cannot bind (an expert whose gate and up are
stored in different types) stays op by op."""

from __future__ import annotations

import pytest
import torch

from tests.model.conftest import one_term_slack
from tests.model.test_fused_decode import decode_chunks, fused_then_eager, ids, prefill, prompt_as_rows
from tests.moe_gguf import write_moe_gguf
from tests.tiny_models import make_tiny_model
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model.fused_decode_moe import moe_binding
from tokenmill.model.kernels import decode_step
from tokenmill.model.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(not decode_step.available(), reason="needs the C++ kernels and a blocked kernel")

SIZES = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2}
# family -> (config overrides, type of each matrix by a part of its name; "" every other one)
CASES = {
    # 8 experts, top-2: a step of several tokens leaves some experts idle and gives others several rows
    "mixtral": ({"num_local_experts": 8}, {"w2": "Q6_K", "lm_head": "Q6_K", "": "Q4_K"}),
    # without q/k/v biases, which the fused step does not take (Qwen1.5-MoE has them: op by op); experts
    # 160 wide: the step's units of 128 expert columns end in a short one (csrc/decode_step_moe.h)
    "qwen2_moe": ({"moe_intermediate_size": 160, "shared_expert_intermediate_size": 256, "num_experts": 8,
                   "qkv_bias": False},
                  {"shared_expert.": "Q8_0", "down_proj": "Q4_1", "": "Q4_0"}),
}


def runner_for(path, threads: int = 2, kv_tokens: int = 512) -> ModelRunner:
    config = EngineConfig(model=str(path), precision="fast", num_threads=threads, kv_cache_tokens=kv_tokens)
    runner = build_engine_core(config).runner
    return ModelRunner(runner.model, runner.num_pages, runner.page_size, torch.bfloat16, prefill_as_decode_rows=True)


@pytest.fixture(scope="module", params=sorted(CASES))
def moe_gguf(request, tmp_path_factory):
    overrides, mix = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    folder = make_tiny_model(tmp, request.param, tokenizer=False, **SIZES, **overrides)
    quant = lambda name: next((k for part, k in mix.items() if part and part in name), mix[""])  # noqa: E731
    return write_moe_gguf(folder, tmp / "moe.gguf", quant)[0]


def test_fused_moe_step_matches_the_layers_op_by_op(moe_gguf, kernel):
    runner = runner_for(moe_gguf)
    model = runner.model
    assert model.fused_decode, "every expert runs one blocked weight: the step should take the model"
    prompts = [ids(37, 1), ids(21, 2), ids(50, 3)]
    pages = prefill(runner, prompts)
    chunks = decode_chunks(prompts, pages)
    fused = runner.execute(chunks)
    assert model._decode_stack is not None and model._decode_stack.kit == decode_step.KITS[kernel]
    model.fused_decode = False
    eager = runner.execute(chunks)
    assert fused.shape == eager.shape == (6, model.config.vocab_size)
    torch.testing.assert_close(fused, eager, atol=2e-4 * eager.abs().max().item(), rtol=1e-4)
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))


def test_one_row_one_thread_and_many_rows(moe_gguf):
    # batch 1 on one thread (every expert's blocks on it) and 12 single-row sequences (most experts
    # active, several rows each) agree with op by op too.
    runner = runner_for(moe_gguf, threads=1)
    model = runner.model
    prompts = [ids(9 + i, 20 + i) for i in range(12)]
    pages = prefill(runner, prompts)
    for chunks in ([SeqChunk(ids(1, 40), len(prompts[0]), pages[0], sample=True)],
                   [SeqChunk(ids(1, 50 + i), len(p), pg, sample=True) for i, (p, pg) in enumerate(zip(prompts, pages))]):
        model.fused_decode = True
        fused = runner.execute(chunks)
        model.fused_decode = False
        eager = runner.execute(chunks)
        torch.testing.assert_close(fused, eager, atol=2e-4 * eager.abs().max().item(), rtol=1e-4)


def test_the_cut_between_threads_changes_no_bit(moe_gguf):
    # The block cuts its work by thread count and step size: a small step is routed by every thread
    # for itself and multiplies a_hidden's row directly; 40 rows (8 x 256 x 40 router MACs, past the
    # private limit) split the router and gather each expert's rows. 1 and 2 threads give the same
    # bits either way, and 40 rows agree with op by op.
    prompts = [ids(5 + i % 7, 60 + i) for i in range(40)]
    results = []
    for threads in (1, 2):
        runner = runner_for(moe_gguf, threads, kv_tokens=2048)
        pages = prefill(runner, prompts)
        one = [SeqChunk(ids(1, 90), len(prompts[0]), pages[0], sample=True)]
        many = [SeqChunk(ids(1, 100 + i), len(p), pg, sample=True) for i, (p, pg) in enumerate(zip(prompts, pages))]
        results.append([runner.execute(one), runner.execute(many)])
        assert runner.model._decode_stack is not None
    for a, b in zip(*results):
        assert torch.equal(a, b)
    runner.model.fused_decode = False
    eager = runner.execute(many)
    torch.testing.assert_close(results[1][1], eager, atol=2e-4 * eager.abs().max().item(), rtol=1e-4)


def test_experts_of_mixed_types_stay_op_by_op(tmp_path):
    folder = make_tiny_model(tmp_path, "mixtral", tokenizer=False, **SIZES)
    path, _ = write_moe_gguf(folder, tmp_path / "mixed.gguf", lambda name: "Q8_0" if "w3" in name else "Q4_0")
    model = runner_for(path).model
    assert moe_binding(model.layers[0]) is None and not model.fused_decode


def test_a_step_of_many_rows_matches_the_layers_op_by_op(moe_gguf, request):
    # 64 rows: on a CPU with AMX the step's attention linears and the shared expert's gate_up take the
    # tiles from their rows split once; the normed inputs keep their int8 terms too, which the experts
    # gather and multiply on the VNNI kernel, where op by op an expert (or the shared expert's down) of
    # 48+ rows takes the tiles: the two agree to the int8 terms' rounding (measured 2.4e-4 of the
    # largest logit, so 1e-3 here; a wrong row or expert is of the logits' own size), or to one bf16
    # term's where the tiles' format takes one (mixtral's Q6_K w2: 1.8e-3; conftest.one_term_slack)
    runner = runner_for(moe_gguf)
    fused, eager = fused_then_eager(runner, prompt_as_rows(runner, 64, 7))
    slack = one_term_slack(*CASES[request.node.callspec.params["moe_gguf"]][1].values())
    torch.testing.assert_close(fused, eager, atol=1e-3 * slack * eager.abs().max().item(), rtol=1e-4)
    assert (fused.argmax(-1) == eager.argmax(-1)).float().mean() > 0.95
