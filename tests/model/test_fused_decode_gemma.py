"""The gemma family's fused decode step (csrc/decode_step_gemma.h) computes what gemma's layers do
op by op, for tiny quantized Gemma 2 (soft-caps) and Gemma 3 (q/k norms, two RoPE tables) models
with a window of 8 tokens: the same logits to float rounding and the same K/V, for decode rows and
speculative runs past the window; it takes one block table per layer and never reads the entries of
a sliding layer's pages wholly before the window."""

from __future__ import annotations

import pytest
import torch

from tests.model.conftest import one_term_slack
from tests.model.test_fused_decode import decode_chunks, ids, prefill
from tests.tiny_models import GEMMA_ARCHS, GEMMA_WINDOW, make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model import fused_decode_gemma
from tokenmill.model.kernels import decode_step
from tokenmill.model.kv_cache_format import ROTATED_HEAD_DIMS, KVCacheFormat
from tokenmill.model.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(not decode_step.available(), reason="needs the C++ kernels and a blocked kernel")


@pytest.fixture(scope="module", params=GEMMA_ARCHS)
def fast_runner(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    folder = make_tiny_model(tmp, request.param, tokenizer=False, hidden_size=128, intermediate_size=256)
    gguf = write_tiny_gguf(folder, tmp / "tiny.gguf", quant="Q8_0")
    config = EngineConfig(model=str(gguf), precision="fast", num_threads=2, kv_cache_tokens=512)
    runner = build_engine_core(config).runner
    return ModelRunner(runner.model, runner.num_pages, runner.page_size, torch.bfloat16, prefill_as_decode_rows=True)


def run_both(runner: ModelRunner, chunks: list[SeqChunk]):
    """(fused logits, its K/V, op-by-op logits): the op-by-op step rewrites the same slots."""
    model = runner.model
    model.fused_decode = True
    fused = runner.execute(chunks)
    kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    model.fused_decode = False
    try:
        return fused, kv, runner.execute(chunks)
    finally:
        model.fused_decode = True


def test_fused_step_matches_the_layers_op_by_op(fast_runner, kernel):
    # the stack is built for the kit of `kernel`; the layers op by op stay on the machine's kernel
    runner = fast_runner
    model = runner.model
    assert model.fused_decode, "the tiny quantized gemma should take the fused path"
    assert any("fused C++ call" in line for line in model.describe())
    prompts = [ids(37, 1), ids(21, 2), ids(50, 3)]  # all past the window of 8
    assert min(map(len, prompts)) > 2 * GEMMA_WINDOW
    pages = prefill(runner, prompts)
    model._decode_stack = None
    fused, fused_kv, eager = run_both(runner, decode_chunks(prompts, pages))
    assert model._decode_stack is not None  # the step really went through the C++ stack
    assert model._decode_stack.kit == decode_step.KITS[kernel]
    model._decode_stack = None  # the other tests' stacks are the machine's kit
    assert fused.shape == eager.shape == (1 + 4 + 1, model.config.vocab_size)
    torch.testing.assert_close(fused, eager, atol=2e-3 * eager.abs().max().item(), rtol=1e-3)
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))
    for (kf, vf), (ke, ve) in zip(fused_kv, runner.kv_caches):
        torch.testing.assert_close(kf.float(), ke.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(vf.float(), ve.float(), atol=1e-2, rtol=1e-2)


def test_fused_step_matches_the_layers_over_int8_rows(fast_runner):
    # int8 rows hold codes of H x (kv_cache_format.py): the stack's writer and its attention rotate
    # as the op-by-op path's do, past the window too
    model = fast_runner.model
    runner = ModelRunner(model, fast_runner.num_pages, fast_runner.page_size, torch.int8, prefill_as_decode_rows=True)
    assert runner.kv_caches[0][0].dtype == torch.int8 and model.config.head_dim in ROTATED_HEAD_DIMS
    prompts = [ids(37, 4), ids(21, 5), ids(50, 6)]
    pages = prefill(runner, prompts)
    model._decode_stack = None
    fused, fused_kv, eager = run_both(runner, decode_chunks(prompts, pages))
    assert model._decode_stack is not None and model._decode_stack.kv_caches is runner.kv_caches
    torch.testing.assert_close(fused, eager, atol=2e-3 * eager.abs().max().item(), rtol=1e-3)
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))
    int8 = KVCacheFormat.named("int8")
    for (kf, vf), (ke, ve) in zip(fused_kv, runner.kv_caches):
        torch.testing.assert_close(int8.decode(kf), int8.decode(ke), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(int8.decode(vf), int8.decode(ve), atol=2e-2, rtol=1e-2)
    model._decode_stack = None  # the other tests' runner binds its own caches


def test_short_prompts_run_fused_as_decode_rows(fast_runner):
    """A prompt of up to MAX_ROWS tokens is one fused step of runs of rows; every position's logits
    agree with the layers op by op."""
    runner = fast_runner
    chunk = [SeqChunk(ids(fused_decode_gemma.GemmaFusedDecodeStack.MAX_ROWS, 9), 0, list(range(20, 30)),
                      sample=True, all_logits=True)]
    fused, _, eager = run_both(runner, chunk)
    # 3e-3 of the largest logit, as for long prompts below: 191 rows of this tiny random gemma 3 measured
    # 2.0e-3 on the VNNI kernel and 2.3e-3 on AMX tiles (both paths' linears; the rest differs in order),
    # times the slack of the tiles' one bf16 term for Q8_0 (4.2e-3 measured; conftest.one_term_slack)
    torch.testing.assert_close(fused, eager, atol=3e-3 * one_term_slack("Q8_0") * eager.abs().max().item(), rtol=1e-3)
    assert (fused.argmax(-1) == eager.argmax(-1)).float().mean() > 0.9


def test_one_block_table_per_layer(fast_runner, monkeypatch):
    """Sliding layers may get their own table (a hybrid KV cache's group): here a copy whose entries
    of pages wholly before the window point outside the pool. The results do not change, and a bad
    entry inside a window is still an error."""
    runner = fast_runner
    model = runner.model
    prompts = [ids(45, 4), ids(30, 5), ids(60, 6)]
    pages = prefill(runner, prompts)
    chunks = decode_chunks(prompts, pages)
    shared, _, _ = run_both(runner, chunks)
    size, window = runner.page_size, model.config.sliding_window
    real = fused_decode_gemma.layer_tables

    def per_layer(meta, num_layers, poison_at=None):
        slots, tables = real(meta, num_layers)
        table = meta.decode_block_table.clone()
        for row, length in enumerate(meta.decode_seq_lens.tolist()):
            table[row, : max(0, length - window) // size] = 10**9
        if poison_at is not None:
            table[0, poison_at] = 10**9
        sliding = [table.clone() for _ in range(num_layers)]  # distinct tensors, as groups would be
        return slots, [sliding[i] if layer.sliding else t for i, (layer, t) in enumerate(zip(model.layers, tables))]

    monkeypatch.setattr(fused_decode_gemma, "layer_tables", per_layer)
    model._decode_stack = None
    separate = runner.execute(chunks)
    torch.testing.assert_close(separate, shared, atol=0, rtol=0)
    last_page = (len(prompts[0])) // size  # the page of the first row's own token
    monkeypatch.setattr(fused_decode_gemma, "layer_tables", lambda m, n: per_layer(m, n, poison_at=last_page))
    with pytest.raises(RuntimeError, match="outside the pool"):
        runner.execute(chunks)


def test_long_prompts_run_in_the_stack(fast_runner):
    """Fast mode sends whole prompts as decode rows; past MAX_ROWS too they are one fused step (the
    linears run the VNNI kernel at any row count), runs of 16 rows with windows starting at different
    positions; every position's logits agree with the layers op by op."""
    runner = fast_runner
    model = runner.model
    assert model.prompts_in_stack
    n = fused_decode_gemma.GemmaFusedDecodeStack.MAX_ROWS + 40
    chunk = [SeqChunk(ids(n, 10), 0, list(range(16, 16 + -(-n // runner.page_size))), sample=True, all_logits=True)]
    model._decode_stack = None
    fused, _, eager = run_both(runner, chunk)
    assert model._decode_stack is not None  # the prompt went through the C++ stack
    assert fused.shape == (n, model.config.vocab_size)
    # 3e-3 of the largest logit, not 2e-3 as for short steps: over 231 rows the two orders of float
    # rounding (the stack's fp32 rows against op-by-op torch ops, the same kernels' integer sums)
    # moved 3 of 11M logits by up to 2.3e-3 of it once activations were rounded in merged two-term steps;
    # op by op the tiles' one bf16 term for Q8_0 moved some by 5.6e-3 (conftest.one_term_slack).
    torch.testing.assert_close(fused, eager, atol=3e-3 * one_term_slack("Q8_0") * eager.abs().max().item(), rtol=1e-3)
    assert (fused.argmax(-1) == eager.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_a_long_row_split_between_threads_matches_op_by_op(tmp_path, kv_dtype):
    # batch-1 decode at 301 positions on pages of 8: the global layers' pages in parts, one a thread,
    # merged before o; the sliding layers' 8 positions stay whole
    folder = make_tiny_model(tmp_path, GEMMA_ARCHS[-1], tokenizer=False, hidden_size=128, intermediate_size=256)
    gguf = write_tiny_gguf(folder, tmp_path / "tiny.gguf", quant="Q8_0")
    config = EngineConfig(model=str(gguf), precision="fast", num_threads=2, kv_cache_tokens=512, page_size=8)
    built = build_engine_core(config).runner
    runner = ModelRunner(built.model, built.num_pages, 8, kv_dtype, prefill_as_decode_rows=True)
    c = runner.model.config
    prompt = ids(300, 8)
    pages = prefill(runner, [prompt])
    items = torch.ops.tokenmill_cpu.decode_attention_items(torch.tensor([pages[0]]), torch.tensor([301]), 8,
                                                           c.num_heads, c.num_kv_heads, c.head_dim, 2)
    assert int(items[:, 4].max()) >= 2
    runner.model._decode_stack = None
    fused, fused_kv, eager = run_both(runner, [SeqChunk(ids(1, 14), len(prompt), pages[0], sample=True)])
    assert runner.model._decode_stack is not None
    torch.testing.assert_close(fused, eager, atol=2e-3 * eager.abs().max().item(), rtol=1e-3)
    values = KVCacheFormat.of(kv_dtype).decode
    for (kf, vf), (ke, ve) in zip(fused_kv, runner.kv_caches):
        torch.testing.assert_close(values(kf), values(ke), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(values(vf), values(ve), atol=2e-2, rtol=1e-2)
