from __future__ import annotations

import pytest

from tokenmill.kvcache.page_pool import PagePool
from tokenmill.kvcache.radix_cache import RadixCache

PS = 2  # page size: small, so keys stay readable


def make(num_pages: int = 32) -> tuple[RadixCache, PagePool]:
    pool = PagePool(num_pages, PS)
    return RadixCache(pool), pool


def put(cache: RadixCache, pool: PagePool, tokens: list[int], salt: str | None = None) -> list[int]:
    """Inserts `tokens` with fresh pages, frees the ones the tree did not take; returns the tree's."""
    mine = pool.allocate(len(tokens) // PS)
    result = cache.insert(tokens, mine, salt)
    pool.free([p for p, t in zip(mine, result.pages) if p != t])
    return result.pages


def check(cache: RadixCache, pool: PagePool, locked=()) -> None:
    cache.check_integrity(locked)
    pool.check_integrity({"tree": cache.all_pages()})


def test_match_on_an_empty_tree_finds_nothing():
    cache, _ = make()
    m = cache.match([1, 2, 3, 4])
    assert m.node is None and m.pages == []


def test_insert_then_match_whole_and_partial_prefixes():
    cache, pool = make()
    pages = put(cache, pool, [1, 2, 3, 4, 5, 6])
    assert cache.match([1, 2, 3, 4, 5, 6]).pages == pages
    assert cache.match([1, 2, 3, 4, 9, 9]).pages == pages[:2]
    assert cache.match([1, 2, 3, 9]).pages == pages[:1]  # page granularity: 3 matches, 9 does not
    assert cache.match([9, 2]).pages == []
    assert cache.match([]).pages == []
    assert cache.num_pages == 3
    check(cache, pool)


def test_a_match_ending_inside_an_edge_splits_it():
    cache, pool = make()
    pages = put(cache, pool, [1, 2, 3, 4, 5, 6])
    m = cache.match([1, 2, 3, 4])
    assert m.node is not None and m.node.pages == pages[:2]
    assert [c.pages for c in m.node.children.values()] == [pages[2:]]
    assert cache.num_pages == 3
    check(cache, pool)


def test_partial_page_finds_the_cached_page_that_continues_a_match_furthest():
    cache = RadixCache(PagePool(32, 4))
    pool = cache.pool
    first = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], pool.allocate(2)).pages
    second = cache.insert([1, 2, 3, 4, 5, 6, 9, 9, 1, 1, 1, 1], pool.allocate(3)).pages[1:]
    other = cache.insert([5, 5, 5, 5], pool.allocate(1)).pages
    m = cache.match([1, 2, 3, 4])
    node, n = cache.partial_page(m, [5, 6, 9])  # both children start 5, 6; one goes on with 9
    # ... split after its first page, so that a lock on it holds that page alone
    assert (node.pages, n) == (second[:1], 3) and [c.pages for c in node.children.values()] == [second[1:]]
    node, n = cache.partial_page(m, [5, 6, 7])
    assert (node.pages[0], n) == (first[1], 3)
    node, n = cache.partial_page(m, [5, 1, 1])
    assert n == 1 and node.pages[0] in (first[1], second[0])
    assert cache.partial_page(m, [6, 6]) is None and cache.partial_page(m, []) is None
    # From the root (nothing matched in whole pages): the first page itself.
    root = cache.match([])
    node, n = cache.partial_page(root, [5, 5, 5])
    assert (node.pages, n) == (other, 3)
    assert cache.partial_page(cache.match([], "unknown salt"), [1, 2]) is None
    cache.check_integrity([])


def test_insert_of_a_branch_splits_and_keeps_the_shared_pages():
    cache, pool = make()
    first = put(cache, pool, [1, 2, 3, 4, 5, 6])
    second = put(cache, pool, [1, 2, 3, 4, 7, 8, 9, 10])
    assert second[:2] == first[:2] and second[2] not in first
    assert cache.num_pages == 5  # 3 + 2 new: the shared pages are not stored twice
    assert pool.num_free == 32 - 5  # the duplicate copies went back to the pool
    assert cache.match([1, 2, 3, 4, 7, 8]).pages == second[:3]
    check(cache, pool)


def test_insert_of_known_tokens_returns_the_trees_pages():
    cache, pool = make()
    first = put(cache, pool, [1, 2, 3, 4])
    mine = pool.allocate(2)
    result = cache.insert([1, 2, 3, 4], mine)
    assert result.pages == first  # the caller must free `mine`
    pool.free(mine)
    check(cache, pool)


def test_keys_must_be_page_aligned():
    cache, pool = make()
    with pytest.raises(ValueError):
        cache.match([1, 2, 3])
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], pool.allocate(2))


def test_lock_counts_run_up_the_path_and_unlocking_too_often_raises():
    cache, pool = make()
    put(cache, pool, [1, 2, 3, 4, 5, 6])
    put(cache, pool, [1, 2, 7, 8])
    deep = cache.match([1, 2, 3, 4, 5, 6]).node
    other = cache.match([1, 2, 7, 8]).node
    cache.lock(deep)
    cache.lock(other)
    shared = deep.parent
    assert shared is other.parent and shared.lock_ref == 2 and deep.lock_ref == 1
    assert cache.num_locked_pages == 4 and cache.num_evictable_pages == 0
    check(cache, pool, [deep, other])
    with pytest.raises(AssertionError, match="lock_ref"):
        cache.check_integrity([deep])  # a lock the running requests do not account for
    cache.unlock(deep)
    cache.unlock(other)
    assert cache.num_locked_pages == 0
    with pytest.raises(RuntimeError, match="unlock"):
        cache.unlock(other)


def test_splitting_a_locked_edge_keeps_lock_counts_exact():
    cache, pool = make()
    put(cache, pool, [1, 2, 3, 4, 5, 6])
    node = cache.match([1, 2, 3, 4, 5, 6]).node
    cache.lock(node)
    put(cache, pool, [1, 2, 9, 9])  # splits the locked edge after its first page
    assert node.parent.lock_ref == 1 and node.parent.pages and cache.num_locked_pages == 3
    check(cache, pool, [node])
    cache.unlock(node)
    check(cache, pool)


def test_eviction_takes_least_recently_used_leaves_first():
    cache, pool = make()
    a = put(cache, pool, [1, 1, 1, 1])
    b = put(cache, pool, [2, 2, 2, 2])
    c = put(cache, pool, [3, 3, 3, 3])
    cache.match([1, 1, 1, 1])  # a is now the most recent; b the oldest
    assert cache.evict(2) == 2
    assert cache.match([2, 2, 2, 2]).pages == []
    assert cache.match([1, 1, 1, 1]).pages == a and cache.match([3, 3, 3, 3]).pages == c
    assert set(b) <= pool.free_page_ids()
    assert cache.num_evicted_pages == 2
    check(cache, pool)


def test_eviction_trims_a_long_leaf_from_its_tail():
    cache, pool = make()
    pages = put(cache, pool, [1, 2, 3, 4, 5, 6])
    assert cache.evict(1) == 1
    assert pages[2] in pool.free_page_ids()
    assert cache.match([1, 2, 3, 4, 5, 6]).pages == pages[:2]  # the head is still a valid prefix
    check(cache, pool)


def test_eviction_cascades_to_parents_and_skips_locked_paths():
    cache, pool = make()
    put(cache, pool, [1, 2, 3, 4])
    put(cache, pool, [1, 2, 5, 6])
    locked = put(cache, pool, [7, 8, 9, 9])
    node = cache.match([7, 8, 9, 9]).node
    cache.lock(node)
    assert cache.num_evictable_pages == 3
    # Both leaves of the [1, 2] branch go, then their parent, which became an unlocked leaf.
    assert cache.evict(10) == 3
    assert cache.num_pages == 2 and cache.all_pages() == locked
    check(cache, pool, [node])
    cache.unlock(node)
    assert cache.evict_all() == 2 and cache.num_pages == 0
    assert pool.num_free == pool.num_pages
    check(cache, pool)


def test_salts_are_separate_namespaces():
    cache, pool = make()
    mine = put(cache, pool, [1, 2, 3, 4], salt="tenant-a")
    assert cache.match([1, 2, 3, 4], salt="tenant-b").pages == []
    assert cache.match([1, 2, 3, 4]).pages == []  # None is a namespace of its own
    assert cache.match([1, 2, 3, 4], salt="tenant-a").pages == mine
    theirs = put(cache, pool, [1, 2, 3, 4], salt="tenant-b")
    assert not set(theirs) & set(mine)  # same tokens, never the same pages
    check(cache, pool)
    cache.evict_all()
    assert cache.match([1, 2, 3, 4], salt="tenant-a").node is None  # empty namespaces are dropped
    check(cache, pool)
