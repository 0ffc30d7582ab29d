"""Prompt chunks attended in bf16 on AMX tiles, our kernel's or torch's flash attention
(model/prompt_attention.py): the causal and offset masks, bf16 and int8 rows (the rotated basis
undone), the pages gathered in the table's order, and fast mode on an AMX CPU sending long prompt
chunks there while agreeing with the paged kernel's rows."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model import prompt_attention
from tokenmill.model.attention import PrefillSpan, TorchPagedAttention
from tokenmill.model.kernels import prompt_flash
from tokenmill.model.kv_cache_format import KVCacheFormat
from tokenmill.model.runner import (
    BF16_PROMPT_MIN_PAIRS,
    BF16_PROMPT_MIN_ROWS,
    MAX_ROWS_AS_DECODE,
    ModelRunner,
    SeqChunk,
)

BF16 = KVCacheFormat.named("bf16")
INT8 = KVCacheFormat.named("int8")
# bf16 queries and attention weights (8 bits), fp32 sums: outputs, weighted means of values ~N(0, 1),
# within a few bf16 steps of the float64 result.
BOUND = dict(atol=2.5e-2, rtol=2e-2)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 causal attention of q [q_len, heads, hd] at the last q_len positions of k, v [kvh, kv_len, hd]."""
    q_len, heads, hd = q.shape
    kvh, kv_len, _ = k.shape
    group = heads // kvh
    out = torch.empty(q_len, heads, hd, dtype=torch.float64)
    for i in range(q_len):
        seen = kv_len - q_len + i + 1
        for h in range(heads):
            keys, values = k[h // group, :seen].double(), v[h // group, :seen].double()
            probs = torch.softmax(keys @ q[i, h].double() * hd**-0.5, dim=0)
            out[i, h] = probs @ values
    return out


@pytest.fixture(params=["tiles", "sdpa"])
def path(request, monkeypatch):
    """Each test below on both of the bf16 path's kernels: ours where it runs, and torch's flash."""
    if request.param == "tiles" and not prompt_attention.on_tiles():
        pytest.skip("no AMX tiles here for the prompt attention kernel")
    monkeypatch.setattr(prompt_attention, "on_tiles", lambda: request.param == "tiles")
    return request.param


@pytest.mark.parametrize("q_len, kv_len, kvh, group, hd", [
    (40, 40, 3, 3, 64),  # a fresh prompt: is_causal
    (24, 70, 2, 4, 128),  # a chunk after a cached prefix: the offset mask
    (17, 17, 1, 4, 256),  # Gemma's head_dim, one KV head
    (prompt_attention.SPLIT_MIN_QUERIES, 700, 2, 2, 32),  # a long chunk after a prefix: two calls merged
])
def test_bf16_rows_give_causal_attention(path, q_len, kv_len, kvh, group, hd):
    g = torch.Generator().manual_seed(kv_len)
    q = torch.randn(q_len, kvh * group, hd, generator=g)
    k, v = torch.randn(kvh, kv_len, hd, generator=g), torch.randn(kvh, kv_len, hd, generator=g)
    rows_k, rows_v = BF16.encode(k), BF16.encode(v)
    got = prompt_attention.attend(q, rows_k, rows_v, BF16, None)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, rows_k.float(), rows_v.float()), **BOUND)
    # bf16 queries give bf16 outputs (the large steps' bf16 activations)
    assert prompt_attention.attend(q.bfloat16(), rows_k, rows_v, BF16, None).dtype == torch.bfloat16


# rotated rows (more queries than K/V vectors: K/V rotated back; fewer: queries and outputs rotated),
# and a head dim whose rows keep plain codes
@pytest.mark.parametrize("hd, q_len", [(64, 30), (64, 5), (48, 30)])
def test_int8_rows_are_read_in_their_rotated_basis(path, hd, q_len):
    g = torch.Generator().manual_seed(hd)
    q = torch.randn(q_len, 6, hd, generator=g)
    k, v = torch.randn(2, 50, hd, generator=g), torch.randn(2, 50, hd, generator=g)
    k[..., 5] *= 6  # an outlier channel, as keys have (larger ones make scores, and their bf16 error, larger)
    rows_k, rows_v = INT8.encode(k), INT8.encode(v)
    assert INT8.rotated(hd) == (hd == 64)
    got = prompt_attention.attend(q, rows_k, rows_v, INT8, None)
    torch.testing.assert_close(got.double(), reference(q, INT8.decode(rows_k), INT8.decode(rows_v)), **BOUND)


@pytest.mark.parametrize("fmt", [BF16, INT8])
def test_prefill_spans_gather_the_pages_in_table_order(path, fmt):
    g = torch.Generator().manual_seed(3)
    kvh, group, hd, page = 2, 3, 64, 16
    k, v = torch.randn(kvh, 8 * page, hd, generator=g), torch.randn(kvh, 8 * page, hd, generator=g)
    cache_k, cache_v = fmt.encode(k), fmt.encode(v)
    pages = torch.tensor([5, 2, 7])  # 40 tokens of context over three shuffled pages
    q = torch.randn(25, kvh * group, hd, generator=g)
    got = TorchPagedAttention(kvh * group, kvh, hd, bf16_prompts=True)._prefill(q, cache_k, cache_v,
                                                                              PrefillSpan(0, 25, 40, pages), page)
    slots = torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages.tolist()])[:40]
    want = reference(q, fmt.decode(cache_k[:, slots]), fmt.decode(cache_v[:, slots]))
    torch.testing.assert_close(got.double(), want, **BOUND)
    # the fp32 computation of the same span (exact mode's path) is within the same bound
    fp32 = TorchPagedAttention(kvh * group, kvh, hd)._prefill(q, cache_k, cache_v, PrefillSpan(0, 25, 40, pages), page)
    torch.testing.assert_close(fp32.double(), want, atol=1e-5, rtol=1e-5)


def test_fp32_caches_keep_the_fp32_computation():
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 64, 32, generator=g), torch.randn(2, 64, 32, generator=g)
    q = torch.randn(20, 4, 32, generator=g)
    span = PrefillSpan(0, 20, 33, torch.tensor([1, 0, 3]))
    on = TorchPagedAttention(4, 2, 32, bf16_prompts=True)._prefill(q, k, v, span, 16)
    off = TorchPagedAttention(4, 2, 32)._prefill(q, k, v, span, 16)
    assert torch.equal(on, off)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_fast_mode_on_amx_sends_long_prompt_chunks_to_sdpa_and_agrees_with_the_kernel_rows(tmp_path, monkeypatch,
                                                                                           kv_dtype):
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=128, intermediate_size=256,
                             max_position_embeddings=1024)
    gguf = write_tiny_gguf(folder, tmp_path / "tiny.gguf", quant="Q8_0")
    g = torch.Generator().manual_seed(2)
    n = BF16_PROMPT_MIN_ROWS + 20
    prompt = [int(t) for t in torch.randint(100, 250, (2 * n + 3,), generator=g)]
    other = [int(t) for t in torch.randint(100, 250, (21,), generator=g)]
    pages = list(range(-(-len(prompt) // 16)))
    other_pages = [len(pages), len(pages) + 1]

    calls = []
    attend, attend_pages = prompt_attention.attend, prompt_attention.attend_pages
    monkeypatch.setattr(prompt_attention, "attend", lambda *args: calls.append(args[0].shape[0]) or attend(*args))
    monkeypatch.setattr(prompt_attention, "attend_pages",
                        lambda *args: calls.append(args[0].shape[0]) or attend_pages(*args))

    def logits(amx: bool) -> tuple[torch.Tensor, ModelRunner]:
        monkeypatch.setattr(prompt_attention, "faster_here", lambda: amx)
        config = EngineConfig(model=str(gguf), precision="fast", num_threads=2, kv_cache_tokens=1024,
                              kv_cache_dtype=kv_dtype)
        runner = build_engine_core(config).runner
        # another sequence's short prompt (rows); its next token as a decode row in the same step as
        # a fresh long chunk; a chunk after its cached prefix; a short tail: every row's logits
        steps = [[SeqChunk(other[:20], 0, other_pages, sample=True, all_logits=True)],
                 [SeqChunk(other[20:], 20, other_pages, sample=True),
                  SeqChunk(prompt[:n], 0, pages, sample=True, all_logits=True)],
                 [SeqChunk(prompt[n:2 * n], n, pages, sample=True, all_logits=True)],
                 [SeqChunk(prompt[2 * n:], 2 * n, pages, sample=True, all_logits=True)]]
        return torch.cat([runner.execute(step) for step in steps]), runner

    on, runner = logits(True)
    assert runner.model.attention.bf16_prompts and runner.max_rows_as_decode == BF16_PROMPT_MIN_ROWS - 1
    # which chunks take the bf16 path: long ones, and shorter ones with much context (token pairs)
    def as_rows(n: int, start: int) -> bool:
        return runner.attends_as_rows(SeqChunk([1] * n, start, [], sample=True))
    assert not as_rows(BF16_PROMPT_MIN_ROWS, 0) and as_rows(BF16_PROMPT_MIN_ROWS - 1, 0)
    assert not as_rows(64, BF16_PROMPT_MIN_PAIRS // 64) and as_rows(64, BF16_PROMPT_MIN_PAIRS // 64 - 65)
    assert as_rows(MAX_ROWS_AS_DECODE, 10**6)  # speculative rows stay rows at any context
    # the two long chunks in every layer; the 3-token tail as rows of the kernel
    assert calls == [n] * runner.model.config.num_layers * 2
    off, runner = logits(False)
    assert len(calls) == runner.model.config.num_layers * 2
    assert not runner.model.attention.bf16_prompts and runner.max_rows_as_decode > len(prompt)
    assert runner.attends_as_rows(SeqChunk([1] * 64, 10**5, [], sample=True))
    assert on.shape == off.shape == (len(prompt) + len(other), runner.model.config.vocab_size)
    # the same attention in another order: logits within bf16 rounding, and the same argmax wherever
    # the kernel's top two are not a near-tie
    torch.testing.assert_close(on, off, atol=1e-2, rtol=0)
    top2 = off.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2e-2
    assert clear.sum() >= len(prompt) // 3 and torch.equal(on.argmax(-1)[clear], off.argmax(-1)[clear])


# Per step: a fresh chunk; a chunk after as long a prefix beside a fresh one; a decode row beside a fresh
# chunk. int8 rows (head_dim 32: a rotated basis) take bf16 queries where the keys are rotated back (a
# fresh chunk with GQA), and float32 ones where the queries are rotated instead (4 heads x n <= 2 KV
# heads x 2n); a step with a decode row never (the decode kernel reads float32 queries).
@pytest.mark.parametrize("kv_dtype, bf16_queries", [("bf16", [True, True, False]), ("int8", [True, False, False])])
def test_bf16_queries_and_outputs_change_no_logit(tmp_path, monkeypatch, kv_dtype, bf16_queries):
    """A step of prompt chunks that all attend on the flash kernel with their queries as they are
    takes the queries from rope_store in bf16 and gives the attention output on in bf16, and any
    step whose o_proj runs a bf16 GEMM gets its attention output in bf16 (decode rows' included): no
    conversion passes, the same numbers as float32 on the way in and out, to the bit."""
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=128, intermediate_size=256,
                             max_position_embeddings=1024)
    gguf = write_tiny_gguf(folder, tmp_path / "tiny.gguf", quant="Q4_1")
    g = torch.Generator().manual_seed(5)
    n = BF16_PROMPT_MIN_ROWS + 10
    first = [int(t) for t in torch.randint(100, 250, (2 * n,), generator=g)]
    second = [int(t) for t in torch.randint(100, 250, (n + 1,), generator=g)]
    third = [int(t) for t in torch.randint(100, 250, (n,), generator=g)]
    pages = list(range(-(-2 * n // 16)))
    other_pages, third_pages = list(range(40, 40 + -(-(n + 1) // 16))), list(range(80, 80 + -(-n // 16)))
    monkeypatch.setattr(prompt_attention, "faster_here", lambda: True)
    asked, out_dtypes = [], []

    def logits(allow: bool) -> torch.Tensor:
        config = EngineConfig(model=str(gguf), precision="fast", num_threads=2, kv_cache_tokens=2048,
                              kv_cache_dtype=kv_dtype)
        runner = build_engine_core(config).runner
        attention = runner.model.attention
        real_queries = TorchPagedAttention.bf16_queries.__get__(attention)
        real_attend = TorchPagedAttention.attend.__get__(attention)
        attention.bf16_queries = lambda meta, k_cache: asked.append(real_queries(meta, k_cache)) or (allow and real_queries(meta, k_cache))

        def attend(q, k_cache, v_cache, meta, out_dtype=None):
            out_dtypes.append(out_dtype)
            return real_attend(q, k_cache, v_cache, meta, out_dtype if allow else None)
        attention.attend = attend
        steps = [[SeqChunk(first[:n], 0, pages, sample=True, all_logits=True)],
                 [SeqChunk(first[n:], n, pages, sample=True, all_logits=True),
                  SeqChunk(second[:n], 0, other_pages, sample=True, all_logits=True)],
                 [SeqChunk(second[n:], n, other_pages, sample=True, all_logits=True),
                  SeqChunk(third, 0, third_pages, sample=True, all_logits=True)]]
        assert runner.attends_as_rows(steps[2][0]) and not runner.attends_as_rows(steps[2][1])
        return torch.cat([runner.execute(step) for step in steps])

    on = logits(True)
    layers = len(asked) // 3
    assert layers > 0 and asked == [q for q in bf16_queries for _ in range(layers)]
    assert out_dtypes == [torch.bfloat16] * 3 * layers  # every layer's o_proj runs bf16 GEMMs here
    off = logits(False)
    assert torch.equal(on, off)


@pytest.fixture
def fresh_choice():
    prompt_attention.faster_here.cache_clear()
    prompt_attention.on_tiles.cache_clear()
    yield
    prompt_attention.faster_here.cache_clear()
    prompt_attention.on_tiles.cache_clear()


def test_faster_here_needs_amx_and_a_cap_that_allows_it(monkeypatch, fresh_choice):
    monkeypatch.delenv(prompt_attention.CHOICE_ENV, raising=False)
    for below in ("avx2", "avx512"):
        monkeypatch.setenv("TOKENMILL_CPU_ISA", below)
        assert prompt_attention.faster_here() is False
        prompt_attention.faster_here.cache_clear()
    monkeypatch.delenv("TOKENMILL_CPU_ISA")
    assert prompt_attention.faster_here() == bool(torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize("value, bf16_path, ours", [("tiles", True, True), ("sdpa", True, False), (" SDPA ", True, False),
                                                    ("kernel", False, False), ("", None, True)])
def test_the_environment_chooses_the_path(monkeypatch, fresh_choice, value, bf16_path, ours):
    monkeypatch.setenv(prompt_attention.CHOICE_ENV, value)
    if bf16_path is not None:
        assert prompt_attention.faster_here() is bf16_path
    # our tile kernel wherever it runs, unless torch's flash attention is asked for
    assert prompt_attention.on_tiles() is (ours and prompt_flash.available())


def test_an_unknown_choice_is_an_error_that_names_it(monkeypatch, fresh_choice):
    monkeypatch.setenv(prompt_attention.CHOICE_ENV, "flash")
    with pytest.raises(ValueError, match=r"TOKENMILL_PROMPT_ATTENTION='flash' is not one of auto, tiles, sdpa, kernel"):
        prompt_attention.faster_here()
