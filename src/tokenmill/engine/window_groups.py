"""A request's page lists for the sliding-window KV groups (kvcache/kv_groups.py), and their rules.

Group 0 (full attention) keeps using `Request.pages` as before; each sliding group g has
`Request.window_pages[g - 1]`, a list as long as `pages` (entry i covers positions i * page_size
onwards) whose entries are a page id or None where the group holds nothing. The scheduler owns one
`WindowGroups` only for a hybrid model, so llama-style models never pay for any of this.

When pages go:
- Sliding: once `num_computed_tokens` = c, every future query sits at position >= c and sees
  positions >= c - window + 1, so a page wholly before that is never read again and goes back to
  the pool (`slide`, run by the scheduler before it reserves a request's next chunk, so chunked
  prefill and decode both free as they go). Speculative drafts never count in c, so a rejected
  draft's recompute still finds its window. Within one step a chunk of n tokens holds the window
  before its first query plus the chunk (`KVLayout.window_pages`).
- Entries below `num_shared_window_pages` are the prefix tree's (matched at admission, or the
  prompt's last window, which the request hands the tree once its prompt is computed so that the
  same prompt sent again can be matched): the request only stops pointing at them; the rest are its
  own. Its last window reaches the tree at release.
- Preemption, finish and abort give back everything not adopted by the tree (`release`);
  speculative rollback drops the entries past the kept pages (`trim`), as for group 0.

Prefix matching (`usable_prefix`): a cached prefix of k pages serves the request only if every
sliding group still holds, in the tree, the pages covering positions k * page_size - window + 1 ..
k * page_size - 1 (what the first recomputed query must see); otherwise the match is cut back to the
longest k that does (possibly 0: the request computes from the start). Never a wrong hit, only a
shorter one.
"""

from __future__ import annotations

from tokenmill.engine.request import Request
from tokenmill.kvcache.kv_groups import KVLayout
from tokenmill.kvcache.page_pool import PagePool
from tokenmill.kvcache.radix_cache import RadixCache


class WindowGroups:
    def __init__(self, layout: KVLayout, pool: PagePool, cache: RadixCache | None) -> None:
        if not layout.is_hybrid or layout.window is None:
            raise ValueError("WindowGroups is for hybrid layouts (a full group and sliding groups)")
        self.count = layout.num_window_groups
        self.window = layout.window
        self.pool = pool
        self.cache = cache  # the tree's sliding pages a request uses are registered there (ref_window)
        self.page_size = pool.page_size

    def first_needed_page(self, num_computed: int) -> int:
        """Index of the first page a query at position >= num_computed can still see."""
        return max(0, num_computed - self.window + 1) // self.page_size

    # ---- allocation and freeing ------------------------------------------------------------------
    def extend(self, request: Request, count: int) -> None:
        """`count` more pages for every sliding group (the same new positions group 0 just got)."""
        if not request.window_pages:
            request.window_pages = [[] for _ in range(self.count)]
        for pages in request.window_pages:
            pages.extend(self.pool.allocate(count))

    def slide(self, request: Request) -> None:
        """Frees (or, for the tree's, lets go of) the sliding pages no future query of `request` reads."""
        cut = min(self.first_needed_page(request.num_computed_tokens), len(request.pages))
        start = request.window_start
        if cut <= start:
            return
        shared = request.num_shared_window_pages
        mine = [p for pages in request.window_pages for i, p in enumerate(pages[start:cut], start)
                if p is not None and i >= shared]
        if self.cache is not None and start < shared:
            self.cache.unref_window(p for pages in request.window_pages for p in pages[start:min(cut, shared)])
        for pages in request.window_pages:
            pages[start:cut] = [None] * (cut - start)
        request.window_start = cut
        self.pool.free(mine)

    def trim(self, request: Request, keep: int) -> None:
        """Drops the entries past the first `keep` pages (rejected drafts' pages)."""
        for pages in request.window_pages:
            self.pool.free([p for p in pages[keep:] if p is not None])
            del pages[keep:]

    def private(self, request: Request) -> list[int]:
        """The sliding pages `request` owns (not the tree's)."""
        shared = request.num_shared_window_pages
        return [p for pages in request.window_pages for p in pages[shared:] if p is not None]

    def offer(self, request: Request, num_full: int) -> list[list[int | None]]:
        """What `request` may give the tree for its first `num_full` pages: its own pages, None where
        it has none or the tree's entry already is the tree's."""
        shared = request.num_shared_window_pages
        return [[None if i < shared else p for i, p in enumerate(pages[:num_full])] for pages in request.window_pages]

    def shared_in_use(self, request: Request) -> list[int]:
        """The tree's sliding pages `request` uses."""
        start, shared = request.window_start, request.num_shared_window_pages
        return [p for pages in request.window_pages for p in pages[start:shared] if p is not None]

    def release(self, request: Request, adopted: set[int]) -> None:
        """Gives back every sliding page `request` owns that the tree did not just adopt."""
        self.pool.free([p for p in self.private(request) if p not in adopted])
        self.forget(request)

    def forget(self, request: Request) -> None:
        """Lets go of the tree's sliding pages and clears the lists (the request's own are gone)."""
        if self.cache is not None:
            self.cache.unref_window(self.shared_in_use(request))
        request.window_pages = []
        request.num_shared_window_pages = 0
        request.window_start = 0

    # ---- prefix cache ----------------------------------------------------------------------------
    def usable_prefix(self, window: list[list[int | None]], num_pages: int) -> int:
        """The longest k <= num_pages whose last window is held by every sliding group (`window`: the
        tree's sliding pages along the matched path, one list per group)."""
        last_gap = -1  # largest index < i where some group has no page
        gaps = [-1] * (num_pages + 1)
        for i in range(num_pages):
            if any(pages[i] is None for pages in window):
                last_gap = i
            gaps[i + 1] = last_gap
        for k in range(num_pages, 0, -1):
            if gaps[k] < self.first_needed_page(k * self.page_size):
                return k
        return 0

    def prompt_window_offer(self, request: Request, k: int) -> list[list[int | None]] | None:
        """The request's own pages for the window before page k (None entries elsewhere), or None if
        it no longer holds all of them."""
        lo, shared = self.first_needed_page(k * self.page_size), request.num_shared_window_pages
        offer = [[None] * k for _ in range(self.count)]
        for mine, pages in zip(offer, request.window_pages):
            for i in range(max(lo, shared), k):
                if pages[i] is None:
                    return None
                mine[i] = pages[i]
        return offer

    def share_window(self, request: Request, k: int, tree: list[list[int | None]], adopted: set[int]) -> None:
        """After the tree took (or already had) the window before page k: the request uses the tree's
        pages there, frees its own copies the tree did not take and the pages before that window
        (no future query of a request past page k sees them)."""
        lo, shared = self.first_needed_page(k * self.page_size), request.num_shared_window_pages
        mine: list[int] = []
        used: list[int] = []
        dropped: list[int] = []
        for pages, theirs in zip(request.window_pages, tree):
            for i in range(max(request.window_start, shared), k):
                if pages[i] is not None and pages[i] not in adopted:
                    mine.append(pages[i])
                pages[i] = theirs[i] if i >= lo else None
                if i >= lo:
                    used.append(pages[i])
            for i in range(request.window_start, min(lo, shared)):
                dropped.append(pages[i])
                pages[i] = None  # the tree's: only let go
        assert self.cache is not None
        self.cache.ref_window(used)
        self.cache.unref_window(dropped)
        request.num_shared_window_pages = k
        request.window_start = max(request.window_start, lo)
        self.pool.free(mine)

    def adopt_match(self, request: Request, window: list[list[int | None]], num_pages: int) -> None:
        """Points `request` at the tree's sliding pages its first query needs (the tree keeps them)."""
        start = self.first_needed_page(num_pages * self.page_size)
        request.window_pages = [[None] * start + list(pages[start:num_pages]) for pages in window]
        request.num_shared_window_pages = num_pages
        request.window_start = start
        assert self.cache is not None
        self.cache.ref_window(self.shared_in_use(request))

    def check(self, request: Request) -> None:
        """Each list is as long as `pages`; None exactly before `window_start`."""
        if not request.window_pages:
            if request.pages:
                raise AssertionError(f"request {request.request_id!r} holds pages but no sliding-group pages")
            return
        for g, pages in enumerate(request.window_pages, 1):
            if len(pages) != len(request.pages):
                raise AssertionError(f"request {request.request_id!r}: group {g} covers {len(pages)} pages, "
                                     f"group 0 {len(request.pages)}")
            start = request.window_start
            if any(p is not None for p in pages[:start]) or any(p is None for p in pages[start:]):
                raise AssertionError(f"request {request.request_id!r}: group {g}'s pages are not exactly "
                                     f"those from page {start} on")
