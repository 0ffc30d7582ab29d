"""The C++ paged-attention kernel's sliding window and soft-capping (Gemma 2 / 3) against a float64
reference, on every skeleton (vector rows, plain-loop rows, runs of one sequence's rows) and every
SIMD variant the CPU has. Slots before each row's window hold NaN and the block-table entries of
pages wholly before it an id far outside the pool: a read of either would show in the output or
fail the page check, as a hybrid KV cache frees those pages."""

from __future__ import annotations

import pytest
import torch

from tests.test_cpu_attention_kernel import make_case, make_runs
from tokenmill.model import cpu_attention_kernel as kernel
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.window_attention import WindowedPagedAttention

FREED = 10**9  # a block-table entry of a freed page: outside any pool


@pytest.fixture(scope="module")
def built():
    if kernel.disabled() or not kernel.available():
        pytest.skip("the CPU attention kernel is not available here")


def first_visible(length: int, window: int | None) -> int:
    return max(0, length - window) if window else 0


def reference(q, k_cache, v_cache, table, lens, page_size, scale, window, softcap):
    """float64: scores scaled, capped, then masked to the window (transformers' eager order)."""
    nd, heads, hd = q.shape
    group = heads // k_cache.shape[0]
    out = torch.empty(nd, heads, hd, dtype=torch.float64)
    for row in range(nd):
        length = int(lens[row])
        pos = torch.arange(first_visible(length, window), length)
        slots = table[row, pos // page_size] * page_size + pos % page_size
        for h in range(heads):
            keys, values = k_cache[h // group, slots].double(), v_cache[h // group, slots].double()
            scores = keys @ q[row, h].double() * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            out[row, h] = torch.softmax(scores, dim=0) @ values
    return out


def poison(k_cache, v_cache, table, lens, page_size, window, owners=None):
    """NaN in every slot of a position before the window of the first row of each sequence, and
    FREED in the table entries of its pages wholly before it. Returns the poisoned table."""
    table = table.clone()
    owners = list(range(len(lens))) if owners is None else owners
    for seq in sorted(set(owners)):
        rows = [r for r, o in enumerate(owners) if o == seq]
        lo = first_visible(int(lens[rows[0]]), window)
        pos = torch.arange(lo)
        slots = table[rows[0], pos // page_size] * page_size + pos % page_size
        k_cache[:, slots] = float("nan")
        v_cache[:, slots] = float("nan")
        table[rows, : lo // page_size] = FREED
    return table


CASES = [
    # lengths, kv_heads, group, head_dim, page_size, window
    ([1, 16, 17, 40, 300, 33], 2, 2, 64, 16, 16),  # window a page: rows shorter, equal, longer
    ([5, 30, 31, 100, 451], 1, 4, 256, 16, 24),  # gemma 3's shape: head_dim 256, one KV head
    ([2, 12, 20, 13, 64], 2, 3, 16, 4, 7),  # odd window across small pages
    ([1, 33, 64, 200], 2, 3, 24, 8, 20),  # no vector branch: plain loops
    ([9, 300, 40], 3, 3, 128, 16, 1),  # a window of one token: the row's own
]


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("lengths,kv_heads,group,head_dim,page_size,window", CASES)
def test_rows_see_only_their_window(built, lengths, kv_heads, group, head_dim, page_size, window, softcap):
    q, k_cache, v_cache, table, lens = make_case(lengths, kv_heads, group, head_dim, page_size, seed=window)
    scale = head_dim**-0.5
    ref = reference(q, k_cache, v_cache, table, lens, page_size, scale, window, softcap)
    table = poison(k_cache, v_cache, table, lens, page_size, window)
    for isa in range(kernel.best_isa() + 1):
        out = kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, page_size, scale, isa=isa,
                                            window=window, softcap=softcap)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m, isa=isa: f"isa {isa}: {m}")


@pytest.mark.parametrize("lengths,kv_heads,group,head_dim,page_size", [([1, 40, 300], 2, 3, 64, 16),
                                                                       ([7, 100], 1, 4, 256, 16)])
def test_softcap_without_window(built, lengths, kv_heads, group, head_dim, page_size):
    q, k_cache, v_cache, table, lens = make_case(lengths, kv_heads, group, head_dim, page_size, seed=7)
    q = q * 10  # scores well past the cap, where tanh bends them
    ref = reference(q, k_cache, v_cache, table, lens, page_size, 0.125, None, 20.0)
    plain = reference(q, k_cache, v_cache, table, lens, page_size, 0.125, None, None)
    out = kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, page_size, 0.125, softcap=20.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.double(), plain, atol=1e-3)  # the cap changed the result


RUN_CASES = [
    # runs (start, n), kv_heads, group, head_dim, page_size, window
    ([(450, 9)], 3, 3, 64, 16, 40),  # a run whose rows' windows start on different positions
    ([(15, 3), (40, 0), (31, 9), (100, 5)], 2, 2, 64, 8, 20),  # windows across page boundaries
    ([(300, 16), (20, 4)], 1, 4, 256, 16, 24),  # gemma 3's shape: head_dim 256, one KV head
    ([(60, 8)], 2, 4, 128, 16, 4),  # a window shorter than the run: rows see disjoint positions
    ([(200, 16)], 2, 3, 64, 16, 512),  # a window longer than the context: all of it
    ([(450, 9)], 1, 3, 64, 16, 200),  # one item's pages split in parts between threads
]


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("runs,kv_heads,group,head_dim,page_size,window", RUN_CASES)
def test_runs_see_only_their_windows(built, runs, kv_heads, group, head_dim, page_size, window, softcap):
    """Runs (prompts as decode rows, draft tokens), also split between threads in parts."""
    q, k_cache, v_cache, table, lens = make_runs(runs, kv_heads, group, head_dim, page_size, seed=window)
    owners = [i for i, (_, n) in enumerate(runs) for _ in range(max(n, 1))]
    scale = head_dim**-0.5
    ref = reference(q, k_cache, v_cache, table, lens, page_size, scale, window, softcap)
    table = poison(k_cache, v_cache, table, lens, page_size, window, owners)
    threads = torch.get_num_threads()
    try:
        for isa in range(kernel.best_isa() + 1):
            for n in (1, 3):
                torch.set_num_threads(n)
                out = kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, page_size, scale, isa=isa,
                                                    window=window, softcap=softcap)
                msg = lambda m, isa=isa, n=n: f"isa {isa}, {n} threads: {m}"  # noqa: E731
                torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=msg)
    finally:
        torch.set_num_threads(threads)


def test_bf16_cache_window(built):
    q, k_cache, v_cache, table, lens = make_case([3, 50, 129], 1, 4, 256, 16, seed=11, dtype=torch.bfloat16)
    ref = reference(q, k_cache.float(), v_cache.float(), table, lens, 16, 0.0625, 32, None)
    out = kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, 16, 0.0625, window=32)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_a_freed_page_inside_the_window_is_still_an_error(built):
    q, k_cache, v_cache, table, lens = make_case([40], 1, 2, 64, 8, seed=5)
    bad = table.clone()
    bad[0, 2] = FREED  # positions 16..23: inside a window of 30 ending at 39
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel.paged_decode_attention(q, k_cache, v_cache, bad, lens, 8, 0.125, window=30)
    with pytest.raises(RuntimeError, match="window and softcap"):
        kernel.paged_decode_attention(q, k_cache, v_cache, table, lens, 8, 0.125, window=-1)


def test_windowed_backend_decodes_through_the_kernel(built):
    """WindowedPagedAttention's decode rows: the kernel, the same numbers as its PyTorch path."""
    q, k_cache, v_cache, table, lens = make_case([1, 30, 77, 200], 2, 2, 64, 16, seed=9)
    backend = WindowedPagedAttention(4, 2, 64, 0.1, window=24, softcap=30.0)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), 4, 16, table, None, [], decode_seq_lens=lens)
    assert backend.kernel
    fast = backend._decode(q, k_cache, v_cache, meta)
    backend.kernel = False
    torch.testing.assert_close(fast, backend._decode(q, k_cache, v_cache, meta), atol=2e-5, rtol=1e-5)
