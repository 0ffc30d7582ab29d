"""Cascade attention in the fused decode step (csrc/cascade_attention.h): rows that share a prefix of
whole pages attend it once on the AMX tiles and their own positions on the paged kernel, merged by
the softmax stats. The logits agree with the step without it and with the layers op by op to the
tiles' bf16 rounding, the greedy tokens are the same, and a step below the thresholds computes exactly
what it computed before."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model.kernels import decode_step, prompt_flash
from tokenmill.model.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(not (decode_step.available() and prompt_flash.available()),
                                reason="needs the fused decode step and AMX tiles")

PAGE = 16
SHARED = 320  # 20 pages of a shared prefix


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cascade")
    folder = make_tiny_model(tmp, "llama", tokenizer=False, hidden_size=128, intermediate_size=256)
    return str(write_tiny_gguf(folder, tmp / "tiny.gguf", quant="Q4_1"))


def runner_for(model_file: str, kv_dtype: torch.dtype) -> ModelRunner:
    config = EngineConfig(model=model_file, precision="fast", num_threads=2, kv_cache_tokens=2048)
    runner = build_engine_core(config).runner
    return ModelRunner(runner.model, runner.num_pages, runner.page_size, kv_dtype)


def ids(n: int, seed: int) -> list[int]:
    return [int(i) for i in torch.randint(100, 250, (n,), generator=torch.Generator().manual_seed(seed))]


def decode_rows(runner: ModelRunner, rows: int, strangers: int = 0) -> list[SeqChunk]:
    """`rows` sequences after one SHARED-token prefix (its pages computed once, as the prefix cache
    shares them), 9-40 own tokens each, then `strangers` sequences with prefixes of their own; one
    decode row each."""
    assert runner.page_size == PAGE
    shared_pages = list(range(SHARED // PAGE))
    runner.execute([SeqChunk(ids(SHARED, 1), 0, shared_pages, sample=False)])
    free = len(shared_pages)
    chunks = []
    for i in range(rows + strangers):
        own = 9 + (7 * i) % 32
        length = SHARED + own
        first = shared_pages if i < rows else []
        more = -(-(length + 1) // PAGE) - len(first)  # room for the decode row's token too
        pages, free = first + list(range(free, free + more)), free + more
        if i < rows:
            runner.execute([SeqChunk(ids(own, 100 + i), SHARED, pages, sample=False)])
        else:
            runner.execute([SeqChunk(ids(length, 200 + i), 0, pages, sample=False)])
        chunks.append(SeqChunk(ids(1, 300 + i), length, pages, sample=True))
    return chunks


def step(runner: ModelRunner, chunks: list[SeqChunk], min_rows: int, min_prefix: int = 256) -> torch.Tensor:
    runner.model.fused_decode = True
    runner.execute(chunks)  # binds the stack on the first fused step
    runner.model._decode_stack.set_cascade(min_rows, min_prefix)
    return runner.execute(chunks).float()


def op_by_op(runner: ModelRunner, chunks: list[SeqChunk]) -> torch.Tensor:
    runner.model.fused_decode = False
    try:
        return runner.execute(chunks).float()
    finally:
        runner.model.fused_decode = True


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("strangers", [0, 3])
def test_rows_over_a_shared_prefix_agree_with_the_step_without_it(model_file, kv_dtype, strangers):
    runner = runner_for(model_file, kv_dtype)
    chunks = decode_rows(runner, 16, strangers)
    without = step(runner, chunks, 0)
    cascade = step(runner, chunks, 12)
    eager = op_by_op(runner, chunks)
    assert not torch.equal(cascade, without)  # the prefix really went through the tiles
    scale = eager.abs().max().item()
    # the prefix's bf16 products and weights against the decode kernel's fp32 ones
    torch.testing.assert_close(cascade, eager, atol=2e-2 * scale, rtol=0)
    assert (cascade - eager).abs().max() < 2e-2 * scale
    torch.testing.assert_close(without, eager, atol=2e-4 * scale, rtol=1e-4)
    assert torch.equal(cascade.argmax(-1), without.argmax(-1))
    # rows that do not share the prefix keep the kernel's arithmetic: each row as computed without it
    if strangers:
        assert torch.equal(cascade[16:], without[16:])


def test_below_the_thresholds_a_step_is_what_it_was(model_file):
    runner = runner_for(model_file, torch.bfloat16)
    chunks = decode_rows(runner, 16)
    without = step(runner, chunks, 0)
    assert torch.equal(step(runner, chunks, 17), without)  # fewer rows than asked
    assert torch.equal(step(runner, chunks, 12, SHARED + PAGE), without)  # a shorter prefix than asked
    assert not torch.equal(step(runner, chunks, 16, SHARED), without)  # at both thresholds: on


def test_the_step_writes_only_its_rows_slots(model_file):
    """The tiles read the shared pages in place and write nothing there: every slot but the step's own
    holds what it held; the first layer's new rows are those written without cascade (later layers'
    follow the attention's rounding)."""
    runner = runner_for(model_file, torch.int8)
    chunks = decode_rows(runner, 16)
    step(runner, chunks, 0)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    step(runner, chunks, 12)
    slots = torch.tensor([c.pages[c.start // PAGE] * PAGE + c.start % PAGE for c in chunks])
    others = torch.ones(runner.kv_caches[0][0].shape[1], dtype=torch.bool)
    others[slots] = False
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, runner.kv_caches)):
        assert torch.equal(k0[:, others], k1[:, others]) and torch.equal(v0[:, others], v1[:, others])
        if layer == 0:
            assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_a_bad_threshold_is_an_error(model_file):
    runner = runner_for(model_file, torch.bfloat16)
    step(runner, decode_rows(runner, 2), 0)
    with pytest.raises(RuntimeError, match="the cascade's prefix must be >= 0 tokens"):
        runner.model._decode_stack.set_cascade(12, -1)
