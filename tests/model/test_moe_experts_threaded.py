"""A MoE block's experts one expert a thread (csrc/moe_experts.cpp, model/moe.py): the op-by-op fast
path's outputs bit for bit at every row count (a few rows on the VNNI kernel, 48+ on AMX tiles where
the CPU has them), whole prompts' logits too; the rule for when the threads share experts; bad input
gets an error, and a block whose experts the op cannot take stays op by op."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_fused_decode import ids
from tests.model.test_fused_decode_moe import SIZES, runner_for
from tests.moe_gguf import write_moe_gguf
from tests.tiny_models import make_tiny_model
from tokenmill.model import moe
from tokenmill.model.kernels import moe_experts
from tokenmill.model.runner import SeqChunk

pytestmark = pytest.mark.skipif(not moe_experts.available(), reason="needs the VNNI kernel and the C++ op")


def tiny_moe(tmp_path_factory, name: str, mix: dict[str, str], **overrides) -> object:
    tmp = tmp_path_factory.mktemp(name)
    folder = make_tiny_model(tmp, "mixtral", tokenizer=False, **SIZES, num_local_experts=8, **overrides)
    quant = lambda n: next((k for part, k in mix.items() if part and part in n), mix[""])  # noqa: E731
    return runner_for(write_moe_gguf(folder, tmp / "moe.gguf", quant)[0])


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    # Q4_K experts with Q6_K downs (two sub-blocks a group), as llama-quantize's Q4_K_M makes them
    return tiny_moe(tmp_path_factory, "k_quants", {"w2": "Q6_K", "lm_head": "Q6_K", "": "Q4_K"})


def blocks(runner) -> list[moe.SparseMoE]:
    return [layer.moe_block for layer in runner.model.layers if isinstance(layer, moe.MoEDecoderLayer)]


def grouped(block: moe.SparseMoE, x: torch.Tensor):
    """A step's routing as SparseMoE.__call__ groups it: tokens, weights [n, 1], rows per expert."""
    top_w, top_i = block.route(x)
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order // block.moe.top_k, top_w.reshape(-1)[order, None], torch.bincount(flat, minlength=block.moe.num_experts).tolist()


def spread_route(block: moe.SparseMoE):
    """The block's routing weights, but token t sent to experts t, t + 1, ... (mod E) in turn."""
    route = block.route

    def spread(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, _ = route(x)
        first = torch.arange(x.shape[0])[:, None] * 3 + torch.arange(block.moe.top_k)
        return weights, first % block.moe.num_experts
    return spread


@pytest.mark.parametrize("rows", [1, 3, 16, 60, 200])
def test_threads_give_the_op_by_op_numbers(runner, rows):
    for block in blocks(runner):
        assert block.bound is not None, "every expert runs one blocked weight: the op should take the block"
        x = torch.randn(rows, SIZES["hidden_size"]) * 3
        tokens, weights, counts = grouped(block, x)
        threaded = block.bound(x, tokens, weights.reshape(-1), counts)
        assert torch.equal(threaded, block.experts_op_by_op(x, tokens, weights, counts, fused=True))
        assert not torch.equal(threaded, torch.zeros_like(threaded))


def test_a_prompt_gets_the_same_logits_either_way(tmp_path_factory):
    runner = tiny_moe(tmp_path_factory, "prompt", {"w2": "Q6_K", "lm_head": "Q6_K", "": "Q4_K"})
    for block in blocks(runner):  # the tiny model routes every token alike: spread them over the experts
        block.route = spread_route(block)
    # 220 rows: more than the fused decode step takes, so the layers run op by op
    size = runner.page_size
    chunks = [SeqChunk(ids(120, 1), 0, list(range(-(-120 // size))), sample=True, all_logits=True),
              SeqChunk(ids(100, 2), 0, list(range(16, 16 + -(-100 // size))), sample=True, all_logits=True)]
    called = []
    for block in blocks(runner):
        bound = block.bound
        block.bound = lambda *a, _b=bound: called.append(1) or _b(*a)  # noqa: B023
    threaded = runner.execute(chunks)
    assert called, "a prompt step of 220 rows should take the threaded op"
    saved = [(b, b.bound) for b in blocks(runner)]
    for block, _ in saved:
        block.bound = None
    try:
        op_by_op = runner.execute(chunks)
    finally:
        for block, bound in saved:
            block.bound = bound
    assert torch.equal(threaded, op_by_op)


def test_when_threads_share_experts(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert moe.threads_share_experts([1, 1, 0, 1, 1])           # four experts for two threads
    assert not moe.threads_share_experts([1, 0, 1, 0, 1])       # three: one thread would idle half the step
    assert not moe.threads_share_experts([200, 10, 10, 10, 0])  # one expert holds most of the rows
    assert moe.threads_share_experts([80, 60, 50, 40, 30])


def test_bad_input_is_an_error(runner):
    block = blocks(runner)[0]
    x = torch.randn(5, SIZES["hidden_size"])
    tokens, weights, counts = grouped(block, x)
    with pytest.raises(RuntimeError, match="add up to the assignments"):
        block.bound(x, tokens[:-1], weights.reshape(-1)[:-1], counts)
    with pytest.raises(RuntimeError, match="outside x"):
        block.bound(x, tokens + 5, weights.reshape(-1), counts)
    with pytest.raises(RuntimeError, match="one float32 weight per assignment"):
        block.bound(x, tokens, weights.reshape(-1).double(), counts)


def test_experts_off_the_kernel_stay_op_by_op(tmp_path_factory):
    # Q4_1 experts take a bf16 GEMM from some rows (their prompt path), which the op does not run
    runner = tiny_moe(tmp_path_factory, "q4_1", {"lm_head": "Q6_K", "": "Q4_1"})
    assert all(block.bound is None for block in blocks(runner))
