"""The C++ paged-attention decode kernel against the PyTorch path and a naive float64 reference:
random caches, random (non-contiguous) block tables, lengths of 1, exact page multiples and ragged,
GQA groups 1 and 3, every head_dim branch, every SIMD variant the CPU has, fp32 and bf16 caches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.model import cpu_attention_kernel as kernel
from tokenmill.model.attention import AttentionMetadata, TorchPagedAttention


@pytest.fixture(scope="module")
def built():
    if kernel.disabled():
        pytest.skip(f"{kernel.DISABLE_ENV} is set")
    if not kernel.available():
        pytest.skip("the CPU attention kernel could not be built here (see the warning logged)")


# AVX-512 with AVX512-BF16: runs over bf16 / int8 caches multiply bf16 pairs (tests/test_attention_pairs.py).
PAIRS_ISA = 3


def fp32_product_isas(cache_dtype: torch.dtype) -> range:
    """The variants whose runs multiply in fp32 over this cache: all of them for an fp32 cache, the
    ones below PAIRS_ISA for bf16 and int8 caches."""
    best = kernel.best_isa()
    return range(best + 1) if cache_dtype == torch.float32 else range(min(best, PAIRS_ISA - 1) + 1)


def make_case(lengths, kv_heads, group, head_dim, page_size, seed=0, dtype=torch.float32, spare_pages=5):
    """Random caches whose pages are handed out in a shuffled order, and a padded block table."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lengths]
    num_pages = sum(need) + spare_pages
    order = torch.randperm(num_pages, generator=g)
    k_cache = torch.randn(kv_heads, num_pages * page_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_pages * page_size, head_dim, generator=g).to(dtype)
    max_pages = max(need)
    table = torch.zeros(len(lengths), max_pages, dtype=torch.long)  # padded with page 0, as the runner does
    taken = 0
    for row, n in enumerate(need):
        table[row, :n] = order[taken : taken + n]
        taken += n
    # Scores of a few units, so softmax is far from uniform.
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=g) * 3
    return q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.long)


def row_slots(table, lens, row, page_size):
    """The cache slots of row `row`'s positions 0 .. lens[row] - 1, in order."""
    pos = torch.arange(int(lens[row]))
    return table[row, pos // page_size] * page_size + pos % page_size


def per_head(q, kv_heads, table, lens, page_size, attend):
    """float64 [rows, heads, head_dim]: attend(row, head, its KV head, the row's cache slots)."""
    nd, heads, hd = q.shape
    group = heads // kv_heads
    out = torch.empty(nd, heads, hd, dtype=torch.float64)
    for row in range(nd):
        slots = row_slots(table, lens, row, page_size)
        for h in range(heads):
            out[row, h] = attend(row, h, h // group, slots)
    return out


def naive(q, k_cache, v_cache, table, lens, page_size, scale):
    def attend(row, h, kvh, slots):
        probs = torch.softmax(k_cache[kvh, slots].double() @ q[row, h].double() * scale, dim=0)
        return probs @ v_cache[kvh, slots].double()

    return per_head(q, k_cache.shape[0], table, lens, page_size, attend)


def torch_path(q, k_cache, v_cache, table, lens, page_size):
    """TorchPagedAttention._decode without the kernel: the gather + matmul path."""
    nd, heads, hd = q.shape
    pos = torch.arange(table.shape[1] * page_size)
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)
    mask = torch.zeros(nd, pos.numel()).masked_fill_(~valid, float("-inf")).view(1, nd, 1, -1)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), nd, page_size, table, mask, [], decode_seq_lens=None)
    return TorchPagedAttention(heads, k_cache.shape[0], hd)._decode(q, k_cache, v_cache, meta)


CASES = [
    # lengths, kv_heads, group, head_dim, page_size
    ([1, 16, 32, 17, 5, 48, 3], 3, 3, 64, 16),  # SmolLM2-like: lengths 1, exact page multiples, ragged
    ([1, 2, 7, 9, 40, 33], 2, 1, 64, 4),  # group 1 (MHA)
    ([300, 451, 1, 512, 97], 3, 3, 64, 16),  # long enough for the 8-position blocks and the prefetch
    ([1, 12, 20, 13], 2, 2, 16, 4),  # the tiny test models' head_dim
    ([3, 9, 10, 24], 2, 3, 32, 3),  # qwen3 tiny: head_dim 32, odd page size
    ([130, 1, 64], 2, 4, 128, 16),  # head_dim 128
    ([1, 16, 300], 1, 4, 256, 16),  # Gemma 3: head_dim 256 (two passes of 2 heads), one KV head
    ([40, 7], 1, 3, 256, 16),  # head_dim 256 with a pass of 1 head
    ([1, 17, 40, 300], 2, 2, 64, 16),  # group 2 (the grouped path's other sizes)
    ([1, 17, 40, 200], 1, 6, 64, 16),  # group 6: no compile-time group, the per-head loops
    ([1, 5, 33, 64], 2, 3, 24, 8),  # a head_dim with no vector branch: plain loops
    ([1, 5, 33, 64], 1, 3, 96, 16),  # ditto, and one KV head
]


@pytest.mark.parametrize("lengths,kv_heads,group,head_dim,page_size", CASES)
def test_matches_torch_path_and_reference(built, lengths, kv_heads, group, head_dim, page_size):
    q, k_cache, v_cache, table, lens = make_case(lengths, kv_heads, group, head_dim, page_size)
    scale = head_dim**-0.5
    ref = naive(q, k_cache, v_cache, table, lens, page_size, scale)
    fallback = torch_path(q, k_cache, v_cache, table, lens, page_size)
    torch.testing.assert_close(fallback.double(), ref, atol=1e-5, rtol=1e-5)
    for isa in range(kernel.best_isa() + 1):  # every SIMD variant this CPU can run
        out = kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, page_size, scale, isa=isa)
        assert out.shape == q.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m, isa=isa: f"isa {isa}: {m}")
        torch.testing.assert_close(out, fallback, atol=2e-5, rtol=1e-5)


def test_int32_tables_and_threads(built):
    q, k_cache, v_cache, table, lens = make_case([1, 100, 64, 250, 31, 7, 16, 200], 3, 3, 64, 16, seed=1)
    ref = naive(q, k_cache, v_cache, table, lens, 16, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = kernel.paged_decode_attention(q, k_cache, v_cache, table.int(), lens.int(), 16, 0.125)
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_bf16_cache(built):
    q, k_cache, v_cache, table, lens = make_case([1, 16, 45, 200], 3, 3, 64, 16, seed=2, dtype=torch.bfloat16)
    ref = naive(q, k_cache.float(), v_cache.float(), table, lens, 16, 0.125)
    for isa in range(kernel.best_isa() + 1):
        out = kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, 16, 0.125, isa=isa)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_large_scores_stay_finite(built):
    """Max subtraction: scores in the thousands must not overflow exp."""
    q, k_cache, v_cache, table, lens = make_case([1, 40, 77], 2, 3, 64, 16, seed=3)
    q = q * 200
    out = kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, 16, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive(q, k_cache, v_cache, table, lens, 16, 0.125), atol=1e-5, rtol=1e-5)


def test_rejects_bad_input(built):
    q, k_cache, v_cache, table, lens = make_case([5, 20], 2, 3, 64, 4)
    bad = table.clone()
    bad[1, 0] = 10_000
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel.paged_decode_attention(q, k_cache, v_cache, bad, lens, 4, 0.125)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.paged_decode_attention(q, k_cache, v_cache, table, lens + 100, 4, 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        kernel.paged_decode_attention(q[:, :5], k_cache, v_cache, table, lens, 4, 0.125)


def test_attention_uses_kernel_unless_disabled(built, monkeypatch):
    """TorchPagedAttention._decode goes through the kernel when the runner gives seq lens, and
    TOKENMILL_DISABLE_CPU_KERNEL=1 switches it off; both give the same numbers."""
    q, k_cache, v_cache, table, lens = make_case([1, 16, 45, 200], 3, 3, 64, 16, seed=4)
    ref = torch_path(q, k_cache, v_cache, table, lens, 16)
    pos = torch.arange(table.shape[1] * 16)
    mask = torch.zeros(4, pos.numel()).masked_fill_(~(pos < lens.unsqueeze(1)), float("-inf")).view(1, 4, 1, -1)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), 4, 16, table, mask, [], decode_seq_lens=lens)
    attention = TorchPagedAttention(9, 3, 64)

    calls = []
    real = kernel.paged_decode_attention
    monkeypatch.setattr(kernel, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.testing.assert_close(attention._decode(q, k_cache, v_cache, meta), ref, atol=2e-5, rtol=1e-5)
    assert calls == [1]
    monkeypatch.setenv(kernel.DISABLE_ENV, "1")
    assert not kernel.available()
    attention = TorchPagedAttention(9, 3, 64)  # the backend chooses its path when it is built
    torch.testing.assert_close(attention._decode(q, k_cache, v_cache, meta), ref, atol=0, rtol=0)
    assert calls == [1]
    torch.testing.assert_close(
        attention._decode(q, k_cache, v_cache, dataclasses.replace(meta, decode_seq_lens=None)), ref, atol=0, rtol=0
    )


def test_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    """A broken compiler must not break anything: available() is False with one warning."""
    monkeypatch.setattr(kernel, "_state", None)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.delenv(kernel.DISABLE_ENV, raising=False)
    with caplog.at_level("WARNING", logger=kernel.__name__):
        assert kernel.available() is False
        assert kernel.available() is False
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    assert (next(tmp_path.glob("kernels/*")) / "build.log").exists()
    with pytest.raises(RuntimeError, match="not available"):
        kernel.paged_decode_attention(*make_case([3], 1, 1, 16, 4), 4, 0.25)


def test_missing_compiler_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernel, "_state", None)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-tokenmill")
    monkeypatch.delenv(kernel.DISABLE_ENV, raising=False)
    with caplog.at_level("WARNING", logger=kernel.__name__):
        assert kernel.available() is False
    assert any("no C++ compiler" in r.getMessage() for r in caplog.records)


def make_runs(runs, kv_heads, group, head_dim, page_size, seed=0, dtype=torch.float32):
    """Rows as speculative decoding sends them: for each (start, n), n rows of one sequence with the
    same block table and lengths start + 1 .. start + n; n = 0 is one independent row of `start`."""
    lengths, owners = [], []
    for i, (start, n) in enumerate(runs):
        for r in range(max(n, 1)):
            lengths.append(start + r + 1 if n else start)
            owners.append(i)
    seq_lengths = [start + max(n, 1) for start, n in runs]
    q, k_cache, v_cache, table, _ = make_case(seq_lengths, kv_heads, group, head_dim, page_size, seed, dtype)
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed + 1)) * 3
    return q, k_cache, v_cache, table[owners].contiguous(), torch.tensor(lengths, dtype=torch.long)


RUN_CASES = [
    # runs (start, n), kv_heads, group, head_dim, page_size
    ([(450, n)], 3, 3, 64, 16) for n in range(1, 10)
] + [
    ([(15, 3), (40, 0), (31, 9), (7, 0), (100, 5)], 3, 3, 64, 16),  # page boundaries; independent rows between
    ([(1, 2), (16, 4), (200, 16), (63, 7)], 2, 1, 64, 8),  # MHA: runs of one lane per row
    ([(0, 9), (47, 6), (5, 0)], 2, 4, 128, 16),  # head_dim 128, group 4, a run from an empty cache
    ([(30, 5), (30, 5)], 1, 6, 64, 4),  # two sequences of the same length: two runs, group 6
    ([(300, 8), (2, 3)], 2, 2, 128, 32),
    # Gemma 3's head_dim 256, one KV head: a 64-row prompt (runs of 16, balanced over threads), a draft
    # run, a lone row
    ([(0, 64), (90, 5), (7, 0)], 1, 4, 256, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("runs,kv_heads,group,head_dim,page_size", RUN_CASES)
def test_runs_of_one_sequence_match_rows(built, dtype, runs, kv_heads, group, head_dim, page_size):
    """Consecutive rows of one sequence (shared K/V reads, masked to each row's length) give what
    the rows give one at a time, and the float64 reference, on every variant and thread count."""
    q, k_cache, v_cache, table, lens = make_runs(runs, kv_heads, group, head_dim, page_size, seed=len(runs), dtype=dtype)
    scale = head_dim**-0.5
    ref = naive(q, k_cache.float(), v_cache.float(), table, lens, page_size, scale)
    threads = torch.get_num_threads()
    try:
        for isa in fp32_product_isas(dtype):
            rows = [
                kernel.paged_decode_attention(q[i : i + 1], k_cache, v_cache, table[i : i + 1], lens[i : i + 1], page_size, scale, isa=isa)
                for i in range(len(lens))
            ]
            one_by_one = torch.cat(rows)  # one row per call: never a run
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                out = kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, page_size, scale, isa=isa)
                msg = lambda m, isa=isa, n=n: f"isa {isa}, {n} threads: {m}"  # noqa: E731
                torch.testing.assert_close(out, one_by_one, atol=2e-5, rtol=1e-5, msg=msg)
                torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=msg)
    finally:
        torch.set_num_threads(threads)


SPLIT_CASES = [
    # lengths, kv_heads, group, head_dim, page_size: one long row whose items are fewer than 2 a thread
    ([900], 3, 3, 64, 16),  # SmolLM2 at batch 1: 3 KV heads on 2 threads
    ([2000], 2, 4, 256, 16),  # head_dim 256: two passes of 2 heads
    ([700], 2, 4, 128, 16),
    ([1200], 1, 2, 16, 8),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths,kv_heads,group,head_dim,page_size", SPLIT_CASES)
def test_long_rows_split_between_threads(built, lengths, kv_heads, group, head_dim, page_size, dtype):
    q, k_cache, v_cache, table, lens = make_case(lengths, kv_heads, group, head_dim, page_size, seed=5, dtype=dtype)
    items = torch.ops.tokenmill_cpu.decode_attention_items(table, lens, page_size, kv_heads * group, kv_heads,
                                                           head_dim, 2)
    parts = int(items[0, 4])
    assert parts >= 2 and items.shape[0] == kv_heads * parts  # each KV head's pages in parts
    assert torch.equal(items[:, 3], torch.arange(parts).repeat(kv_heads))
    one = torch.ops.tokenmill_cpu.decode_attention_items(table, lens, page_size, kv_heads * group, kv_heads, head_dim, 1)
    assert kv_heads > 1 or int(one[0, 4]) >= 2  # one KV head is too few items even for one thread
    ref = naive(q, k_cache, v_cache, table, lens, page_size, head_dim**-0.5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for isa in range(kernel.best_isa() + 1):
            out = kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, page_size, head_dim**-0.5, isa=isa)
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m, isa=isa: f"isa {isa}: {m}")
    finally:
        torch.set_num_threads(threads)


def test_short_rows_and_many_rows_stay_whole(built):
    """A split needs kMinRowPartPages (8) pages a part, and fewer items than 2 a thread."""
    cases = (([150], 2, 1), ([16 * 15], 2, 1), ([16 * 16], 2, 2), ([300], 2, 2), ([16 * 32], 2, 2), ([900, 900], 2, 1),
             ([900], 1, 1))
    for lengths, threads, parts in cases:
        _, _, _, table, lens = make_case(lengths, 3, 3, 64, 16)
        items = torch.ops.tokenmill_cpu.decode_attention_items(table, lens, 16, 9, 3, 64, threads)
        assert set(items[:, 4].tolist()) == {parts}, (lengths, threads, items)
    # one KV head of head_dim 256 (Gemma 3): the fused row step splits its query heads instead
    _, _, _, table, lens = make_case([2000], 1, 4, 256, 16)
    assert torch.ops.tokenmill_cpu.decode_attention_items(table, lens, 16, 4, 1, 256, 2)[:, 4].tolist() == [1]
