"""The fused decode step's barriers (csrc/step_barrier.h): the spin barrier computes bit for bit what
`omp barrier` does, on both families' stacks (llama and gemma share the phases of decode_phases.h,
and an MoE model's step mixes them with its block's own barriers), also when every waiter sleeps in
the futex; the barrier log counts each step's barriers; a bad
setting is an error."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_fused_decode import decode_chunks, ids, prefill
from tests.model.test_fused_decode_moe import SIZES
from tests.moe_gguf import write_moe_gguf
from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.bench.decode_step import BARRIER_KINDS, captured_call
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model.kernels import decode_step
from tokenmill.model.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(not decode_step.available(), reason="needs the C++ kernels and AVX512-VNNI")

OMP, SPIN = BARRIER_KINDS["omp"], BARRIER_KINDS["spin"]


@pytest.fixture(scope="module", params=["llama", "llama-mha", "gemma3", "gemma3-hd256", "mixtral"])
def runner(request, tmp_path_factory) -> ModelRunner:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "mixtral":  # MoE layers: decode_step_moe.h's own omp barriers between ours
        folder = make_tiny_model(tmp, "mixtral", tokenizer=False, **SIZES, num_local_experts=8)
        gguf = write_moe_gguf(folder, tmp / "moe.gguf", lambda name: "Q8_0")[0]
    elif request.param == "gemma3-hd256":  # Gemma 3 270M's heads: one row's one item split by query heads
        folder = make_tiny_model(tmp, "gemma3", tokenizer=False, hidden_size=128, intermediate_size=256,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=256)
        gguf = write_tiny_gguf(folder, tmp / "tiny.gguf", quant="Q8_0")
    elif request.param == "llama-mha":  # as many KV heads as query heads: a K head's columns straddle the
        # threads' qkv shares, so one-row steps store each KV head's K/V with its attention item
        folder = make_tiny_model(tmp, "llama", tokenizer=False, hidden_size=128, intermediate_size=256,
                                 num_attention_heads=4, num_key_value_heads=4)
        gguf = write_tiny_gguf(folder, tmp / "tiny.gguf", quant="Q8_0")
    else:
        folder = make_tiny_model(tmp, request.param, tokenizer=False, hidden_size=128, intermediate_size=256)
        gguf = write_tiny_gguf(folder, tmp / "tiny.gguf", quant="Q8_0")
    config = EngineConfig(model=str(gguf), precision="fast", num_threads=2, kv_cache_tokens=512)
    built = build_engine_core(config).runner
    out = ModelRunner(built.model, built.num_pages, built.page_size, torch.bfloat16, prefill_as_decode_rows=True)
    assert out.model.fused_decode, "the tiny quantized model should take the fused path"
    return out


def captured(runner: ModelRunner, chunks: list[SeqChunk]):
    """The model's C++ stack and the arguments of its call for `chunks`."""
    runner.execute(chunks)  # binds the stack
    return captured_call(runner.model, lambda: runner.execute(chunks))


def step(stack, args, kv_caches):
    """(output, K/V caches after) of one call; the call's x is a copy (it is the residual stream)."""
    out = stack.run(args[0].clone(), *args[1:])
    return out, [t.clone() for pair in kv_caches for t in pair]


def test_spin_barrier_computes_what_omp_barrier_does(runner):
    torch.set_num_threads(2)
    prompts = [ids(37, 1), ids(21, 2), ids(50, 3)]
    chunks = decode_chunks(prompts, prefill(runner, prompts))  # plain rows and a speculative run
    stack, args = captured(runner, chunks)
    try:
        stack.set_barrier(OMP, 0, False)
        want, want_kv = step(stack, args, runner.kv_caches)
        # 50 us: waiters spin; 0 us: every waiter sleeps in the futex (its wake-up path); many calls,
        # so that a lost wake-up would hang here rather than in a server.
        for spin_us in (50, 0):
            stack.set_barrier(SPIN, spin_us, False)
            for _ in range(20):
                got, got_kv = step(stack, args, runner.kv_caches)
                assert torch.equal(got, want)
                assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))
    finally:
        stack.set_barrier(OMP, 0, False)


@pytest.mark.parametrize("kind", [OMP, SPIN])
@pytest.mark.parametrize("rows", [1, 2])
def test_the_log_counts_every_barrier_of_a_step(runner, kind, rows):
    """Two decode rows (no split attention runs to merge): one barrier after the first norm, then ten a
    layer (qkv, RoPE + store, attention, its rows rounded, o, norm, gate_up, activation, down, norm).
    One row (every thread holds it, decode_row_phases.h): five a layer (qkv, attention, o, gate_up,
    down)."""
    if any(hasattr(layer, "moe_block") for layer in runner.model.layers):
        pytest.skip("an MoE block passes barriers of its own (decode_step_moe.h), not logged")
    torch.set_num_threads(2)
    prompts = [ids(30, 4), ids(20, 14)][:rows]
    pages = prefill(runner, prompts)
    stack, args = captured(runner, [SeqChunk(ids(1, 5 + j), len(p), pg, sample=True)
                                    for j, (p, pg) in enumerate(zip(prompts, pages))])
    stack.set_barrier(kind, 50, True)
    try:
        assert stack.barrier_stats() == [0.0] * 5  # set_barrier resets the totals
        for _ in range(3):
            stack.run(args[0].clone(), *args[1:])
        steps, barriers, step_ns, wait_ns, late_ns = stack.barrier_stats()
        layers = len(runner.model.layers)
        assert (steps, barriers) == (3, 3 * (5 * layers if rows == 1 else 1 + 10 * layers))
        assert step_ns > 0 and 0 <= late_ns <= wait_ns <= 2 * step_ns
    finally:
        stack.set_barrier(OMP, 0, False)


def _call(runner: ModelRunner, chunks: list[SeqChunk]):
    """The stack and (x before the call, x after, output) of the call that `chunks` make."""
    runner.execute(chunks)  # binds the stack
    holder, seen = runner.model._decode_stack, []
    stack = holder._stack

    class Copying:  # keeps the residual stream's input, which the call updates in place
        def run(self, x, *rest):
            seen.append(x.clone())
            out = stack.run(x, *rest)
            seen.extend([x.clone(), out])
            return out

    holder._stack = Copying()
    try:
        runner.execute(chunks)
    finally:
        holder._stack = stack
    return seen


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_alone_computes_what_it_does_beside_another(runner, threads):
    """A step of one decode row (every thread holds the row, decode_row_phases.h) gives the bits the
    same row gets in a step of two (each row's phases on its owner thread): output, residual stream
    and the K/V it stores, with bf16 caches."""
    torch.set_num_threads(threads)
    prompts = [ids(37, 7), ids(21, 8)]
    pages = prefill(runner, prompts)
    row, other = (SeqChunk(ids(1, 9 + j), len(p), pg, sample=True) for j, (p, pg) in enumerate(zip(prompts, pages)))
    x_pair, after_pair, out_pair = _call(runner, [row, other])
    kv_pair = [t.clone() for pair in runner.kv_caches for t in pair]
    x_one, after_one, out_one = _call(runner, [row])  # rewrites the row's slot
    assert torch.equal(x_one[0], x_pair[0])  # the same input row
    assert torch.equal(out_one[0], out_pair[0])
    assert torch.equal(after_one[0], after_pair[0])
    assert all(torch.equal(a, b) for a, b in zip(kv_pair, [t for pair in runner.kv_caches for t in pair]))


def test_bad_barrier_settings_are_errors(runner):
    prompt = ids(20, 6)
    pages = prefill(runner, [prompt])[0]
    stack, _ = captured(runner, [SeqChunk(ids(1, 7), len(prompt), pages, sample=True)])
    with pytest.raises(RuntimeError, match="barrier kind"):
        stack.set_barrier(2, 50, False)
    with pytest.raises(RuntimeError, match="spin budget"):
        stack.set_barrier(SPIN, -1, False)
