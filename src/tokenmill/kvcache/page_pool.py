"""Bookkeeping for the KV page pool: which page ids are free.

The K/V tensors themselves live with the model runner (`model/kv_cache.py`); this class only hands
out page ids, so the scheduler can reason about memory without touching tensors. Freeing a page that
is already free raises: a double free is always a bug in the caller, and a silent no-op would turn it
into a later, unrelated-looking corruption (two requests writing the same page).
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Asked for more pages than are free; the scheduler preempts or waits."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: a LIFO free list reuses recently freed (cache-warm) pages first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"asked for {count} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} is not in this pool (0..{self.num_pages - 1})")
            if self._is_free[page]:
                raise RuntimeError(f"double free of KV page {page}")
            self._is_free[page] = True
            self._free.append(page)

    def free_page_ids(self) -> set[int]:
        return set(self._free)

    def check_integrity(self, owned: dict[str, list[int]]) -> None:
        """Every page is free or owned by exactly one holder (`owned`: holder -> pages)."""
        seen: dict[int, str] = {}
        for holder, pages in owned.items():
            for page in pages:
                if page in seen:
                    raise AssertionError(f"KV page {page} held by both {seen[page]} and {holder}")
                if self._is_free[page]:
                    raise AssertionError(f"KV page {page} held by {holder} but marked free")
                seen[page] = holder
        if len(set(self._free)) != len(self._free):
            raise AssertionError("the free list holds a page twice")
        missing = self.num_pages - len(self._free) - len(seen)
        if missing:
            raise AssertionError(f"{missing} KV pages are neither free nor held (leaked)")
