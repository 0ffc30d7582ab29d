"""Cascade attention (csrc/cascade_attention.h), in the decode attention op and the fused decode step:
rows that share a prefix of whole pages attend it once on the AMX tiles and their own positions on
the paged kernel, merged by the softmax stats. The op agrees with a float64 reference to the tiles'
bf16 rounding; a step's logits agree with the step without it and with the layers op by op, the
greedy tokens are the same, and a step below the thresholds computes exactly what it did before."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model import cpu_attention_kernel
from tokenmill.model.kernels import decode_step, prompt_flash
from tokenmill.model.kv_cache_format import KVCacheFormat
from tokenmill.model.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(not (decode_step.available() and prompt_flash.available()),
                                reason="needs the fused decode step and AMX tiles")

PAGE = 16
SHARED = 320  # 20 pages of a shared prefix


def op_inputs(fmt: str, rows: int, strangers: int, heads: int, kvh: int, hd: int, seed: int = 0):
    """A pool of pages; `rows` sequences on one SHARED-token prefix's pages then 5-60 own tokens, and
    `strangers` on pages of their own; q of one decode row each."""
    g = torch.Generator().manual_seed(seed)
    pool_pages = SHARED // PAGE + 24 * (rows + strangers)  # room for every row's own pages
    cache = KVCacheFormat.named(fmt)
    k_cache, v_cache = (cache.encode(torch.randn(kvh, pool_pages * PAGE, hd, generator=g)) for _ in range(2))
    shared = list(range(SHARED // PAGE))
    order = torch.randperm(pool_pages - len(shared), generator=g) + len(shared)  # shuffled own pages
    tables, lens, used = [], [], 0
    for i in range(rows + strangers):
        length = SHARED + 5 + (11 * i) % 56
        need = -(-length // PAGE)
        first = shared if i < rows else []
        own = order[used:used + need - len(first)].tolist()
        used += len(own)
        tables.append(first + own)
        lens.append(length)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(rows + strangers, heads, hd, generator=g)
    return q, k_cache, v_cache, table, torch.tensor(lens), cache


def op_reference(q, k_cache, v_cache, table, lens, cache, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[0]
    for r in range(q.shape[0]):
        slots = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in table[r].tolist()])[: lens[r]]
        keys, values = (cache.decode(c[:, slots]).double().repeat_interleave(group, 0) for c in (k_cache, v_cache))
        probs = torch.softmax(torch.einsum("hd,htd->ht", q[r].double(), keys) * scale, -1)
        out[r] = torch.einsum("ht,htd->hd", probs, values)
    return out


@pytest.mark.skipif(not cpu_attention_kernel.available(), reason="needs the CPU attention kernel")
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("heads, kvh, hd", [(9, 3, 64), (4, 1, 256)])  # SmolLM2's; Gemma 3's (keys packed)
def test_the_op_attends_a_shared_prefix_once_to_the_tiles_rounding(fmt, heads, kvh, hd):
    q, k_cache, v_cache, table, lens, cache = op_inputs(fmt, 20, 3, heads, kvh, hd)
    args = (q, k_cache, v_cache, table, lens, PAGE, 0.125)
    plain = cpu_attention_kernel.paged_decode_attention(*args, cascade=(0, 0))
    cascade = cpu_attention_kernel.paged_decode_attention(*args, cascade=(12, 256))
    want = op_reference(q, k_cache, v_cache, table, lens, cache, 0.125)
    assert not torch.equal(cascade[:20], plain[:20])  # the prefix went through the tiles
    torch.testing.assert_close(cascade.double(), want, atol=2.5e-2, rtol=2e-2)  # bf16 products on the prefix
    torch.testing.assert_close(plain.double(), want, atol=1e-3, rtol=1e-3)
    assert torch.equal(cascade[20:], plain[20:])  # rows on pages of their own: the kernel's arithmetic
    # below either threshold: exactly the kernel's
    assert torch.equal(cpu_attention_kernel.paged_decode_attention(*args, cascade=(21, 256)), plain)
    assert torch.equal(cpu_attention_kernel.paged_decode_attention(*args, cascade=(12, SHARED + PAGE)), plain)


@pytest.mark.skipif(not cpu_attention_kernel.available(), reason="needs the CPU attention kernel")
def test_rows_sharing_less_or_another_prefix_are_left_to_the_kernel():
    """The cascade takes the rows and prefix that save the most: a row sharing only the prefix's first
    two pages, and a smaller group under a prefix of its own, keep the kernel's arithmetic, and the
    rest still cascade."""
    q, k_cache, v_cache, table, lens, cache = op_inputs("bf16", 16, 6, 9, 3, 64)
    table[16, :2] = table[0, :2]  # a row whose first 2 pages are the prefix's (the rest its own)
    table[18:22, :8] = table[18, :8]  # four rows sharing 8 pages of their own
    args = (q, k_cache, v_cache, table, lens, PAGE, 0.125)
    plain = cpu_attention_kernel.paged_decode_attention(*args, cascade=(0, 0))
    cascade = cpu_attention_kernel.paged_decode_attention(*args, cascade=(12, 256))
    assert not torch.equal(cascade[:16], plain[:16])
    assert torch.equal(cascade[16:], plain[16:])
    torch.testing.assert_close(cascade.double(), op_reference(q, k_cache, v_cache, table, lens, cache, 0.125),
                               atol=2.5e-2, rtol=2e-2)
    # alone, the four rows' group cascades at thresholds it meets
    q, k_cache, v_cache, table, lens, cache = op_inputs("bf16", 0, 22, 9, 3, 64)
    assert len(set(table[:, 0].tolist())) == 22  # pages of their own
    table[18:22, :8] = table[18, :8]
    args = (q, k_cache, v_cache, table, lens, PAGE, 0.125)
    plain = cpu_attention_kernel.paged_decode_attention(*args, cascade=(0, 0))
    cascade = cpu_attention_kernel.paged_decode_attention(*args, cascade=(4, 128))
    assert [r for r in range(22) if not torch.equal(cascade[r], plain[r])] == [18, 19, 20, 21]
    torch.testing.assert_close(cascade.double(), op_reference(q, k_cache, v_cache, table, lens, cache, 0.125),
                               atol=2.5e-2, rtol=2e-2)


@pytest.mark.skipif(not cpu_attention_kernel.available(), reason="needs the CPU attention kernel")
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_each_system_prompts_rows_cascade_over_their_own_prefix(fmt):
    """Rows under three prefixes (two of them sharing their first pages) and rows on pages of their own:
    each group at the thresholds attends its own prefix once, a group under them keeps the kernel's
    arithmetic, and every row agrees with the float64 reference."""
    q, k_cache, v_cache, table, lens, cache = op_inputs(fmt, 0, 40, 9, 3, 64)
    assert len(set(table[:, 0].tolist())) == 40  # pages of their own
    table[0:13, :20] = table[0, :20]  # 13 rows under one 20-page prefix
    table[13:25, :16] = table[13, :16]  # 12 rows under another, 16 pages
    table[25:33, :16] = table[13, :16]  # 8 more under its first 16 pages, then pages of their own
    table[25:33, 16:20] = table[25, 16:20]
    table[33:37, :20] = table[33, :20]  # 4 rows: below the rows threshold
    args = (q, k_cache, v_cache, table, lens, PAGE, 0.125)
    plain = cpu_attention_kernel.paged_decode_attention(*args, cascade=(0, 0))
    cascade = cpu_attention_kernel.paged_decode_attention(*args, cascade=(8, 256))
    changed = [r for r in range(40) if not torch.equal(cascade[r], plain[r])]
    assert changed == list(range(33))
    torch.testing.assert_close(cascade.double(), op_reference(q, k_cache, v_cache, table, lens, cache, 0.125),
                               atol=2.5e-2, rtol=2e-2)
    # more groups than a step takes: the groups past the limit keep the kernel's arithmetic
    q, k_cache, v_cache, table, lens, cache = op_inputs(fmt, 0, 40, 9, 3, 64)
    for g in range(10):
        table[4 * g:4 * g + 4, :16] = table[4 * g, :16]
    args = (q, k_cache, v_cache, table, lens, PAGE, 0.125)
    plain = cpu_attention_kernel.paged_decode_attention(*args, cascade=(0, 0))
    cascade = cpu_attention_kernel.paged_decode_attention(*args, cascade=(4, 256))
    changed = [r for r in range(40) if not torch.equal(cascade[r], plain[r])]
    assert len(changed) == 32 and all(set(range(4 * (r // 4), 4 * (r // 4) + 4)) <= set(changed) for r in changed)
    torch.testing.assert_close(cascade.double(), op_reference(q, k_cache, v_cache, table, lens, cache, 0.125),
                               atol=2.5e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cascade")
    folder = make_tiny_model(tmp, "llama", tokenizer=False, hidden_size=128, intermediate_size=256)
    return str(write_tiny_gguf(folder, tmp / "tiny.gguf", quant="Q4_1"))


def runner_for(model_file: str, kv_dtype: torch.dtype, tokens: int = 2048) -> ModelRunner:
    config = EngineConfig(model=model_file, precision="fast", num_threads=2, kv_cache_tokens=tokens)
    runner = build_engine_core(config).runner
    return ModelRunner(runner.model, runner.num_pages, runner.page_size, kv_dtype)


def ids(n: int, seed: int) -> list[int]:
    return [int(i) for i in torch.randint(100, 250, (n,), generator=torch.Generator().manual_seed(seed))]


def decode_rows(runner: ModelRunner, rows: int, strangers: int = 0, prefixes: int = 1) -> list[SeqChunk]:
    """`rows` sequences after `prefixes` SHARED-token prefixes (rows dealt out in turn; each prefix's
    pages computed once, as the prefix cache shares them), 9-40 own tokens each, then `strangers`
    sequences with prefixes of their own; one decode row each."""
    assert runner.page_size == PAGE
    per = SHARED // PAGE
    shared = [list(range(g * per, (g + 1) * per)) for g in range(prefixes)]
    for g, pages in enumerate(shared):
        runner.execute([SeqChunk(ids(SHARED, 1 + g), 0, pages, sample=False)])
    free = prefixes * per
    chunks = []
    for i in range(rows + strangers):
        own = 9 + (7 * i) % 32
        length = SHARED + own
        first = shared[i % prefixes] if i < rows else []
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
def test_rows_over_a_shared_prefix_agree_with_the_step_without_it(model_file, kv_dtype, strangers, monkeypatch):
    runner = runner_for(model_file, kv_dtype)
    chunks = decode_rows(runner, 16, strangers)
    without = step(runner, chunks, 0)
    cascade = step(runner, chunks, 12)
    # the op attends the prefix once too (at these rows and prefix when asked)
    monkeypatch.setattr(cpu_attention_kernel, "CASCADE_OP", {kv_dtype: (12, 256)})
    eager = op_by_op(runner, chunks)
    monkeypatch.setattr(cpu_attention_kernel, "_CASCADE_OFF", True)
    eager_without = op_by_op(runner, chunks)
    assert not torch.equal(cascade, without)  # the prefix really went through the tiles
    scale = eager.abs().max().item()
    # the fused step and the layers op by op: the same arithmetic either way, to float rounding
    torch.testing.assert_close(without, eager_without, atol=2e-4 * scale, rtol=1e-4)
    torch.testing.assert_close(cascade, eager, atol=2e-4 * scale, rtol=1e-4)
    # the prefix's bf16 products and weights against the decode kernel's fp32 ones
    assert (cascade - without).abs().max() < 2e-2 * scale
    assert torch.equal(cascade.argmax(-1), without.argmax(-1))
    # rows that do not share the prefix keep the kernel's arithmetic
    if strangers:
        assert torch.equal(cascade[16:], without[16:])


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_rows_under_two_system_prompts_cascade_over_each(model_file, kv_dtype, monkeypatch):
    runner = runner_for(model_file, kv_dtype, 4096)
    chunks = decode_rows(runner, 24, 2, prefixes=2)
    without = step(runner, chunks, 0)
    cascade = step(runner, chunks, 12)
    monkeypatch.setattr(cpu_attention_kernel, "CASCADE_OP", {kv_dtype: (12, 256)})
    eager = op_by_op(runner, chunks)
    for g in range(2):  # each prompt's rows went through the tiles
        assert not torch.equal(cascade[g:24:2], without[g:24:2])
    assert torch.equal(cascade[24:], without[24:])
    scale = eager.abs().max().item()
    torch.testing.assert_close(cascade, eager, atol=2e-4 * scale, rtol=1e-4)
    assert (cascade - without).abs().max() < 2e-2 * scale
    assert torch.equal(cascade.argmax(-1), without.argmax(-1))
    # 13 rows needed: neither group of 12 cascades
    assert torch.equal(step(runner, chunks, 13), without)


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
