"""Admission against the prefix cache: which cached K/V a request starts from.

The scheduler admits the head of its queue in three moves, and this file holds the first and the
undo of it (engine/scheduler.py the rest: pages for the first chunk, then the copy below):
- **Whole pages.** The longest cached page-aligned prefix of the prompt, at most `num_tokens - 1`
  (a full hit still computes the last token: its logits sample the next one), extended by the disk
  tier where the tree's match ends, cut where a sliding group lacks the window before the end;
  locked, and counted as computed.
- **The partial page.** The tree shares whole pages, so a prompt sent again (a retry, "regenerate",
  a benchmark's warm pass) would recompute up to a page of tokens, although the earlier request's
  prompt + output filled that page and put it in the tree. The child of the match's end whose first
  page starts with the most of the next tokens is held (locked; its sliding groups' pages of that
  position referenced) and those tokens count as computed; once the request has pages of its own,
  the runner copies that page into the first of them, in every KV group (`copy_page`), and the hold
  ends. The request overwrites the slots past the matched tokens as it computes those positions.
  No copy where a sliding group has no page there, or the runner cannot copy (`copy_page` None).
- **Undo**, for a request that found no room after all: every hold released, nothing kept. Before
  that the request tries again without the partial page (`drop_tail`): an optimisation must never be
  what keeps it waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenmill.engine.request import Request
from tokenmill.engine.window_groups import WindowGroups
from tokenmill.kvcache.page_pool import PagePool
from tokenmill.kvcache.radix_cache import RadixCache
from tokenmill.kvcache.radix_node import PrefixMatch, RadixNode

if TYPE_CHECKING:
    from tokenmill.engine.kv_offload import KVOffload


class PrefixAdmission:
    def __init__(self, cache: RadixCache, pool: PagePool, windows: WindowGroups | None,
                 make_room: Callable[[int], bool]) -> None:
        self.cache = cache
        self.pool = pool
        self.windows = windows
        self.make_room = make_room  # the scheduler's: evicts until that many pages are free, or says no
        self.offload: KVOffload | None = None  # the prefix cache's disk tier, when the engine has one
        # The runner's page copy (src, dst); None: whole pages only (a runner without it, as the tests' fakes).
        self.copy_page: Callable[[int, int], None] | None = None

    def start(self, request: Request) -> RadixNode | None:
        """Starts `request` on what the cache holds of its prompt; returns the partial page's node,
        held until `copy_tail` (or `undo`), or None."""
        if request.needs_prompt_logits or not request.uses_prefix_cache:
            return None  # a request that needs prompt logprobs computes its whole prompt (vLLM does too)
        return self._partial_page(request, self._whole_pages(request))

    def copy_tail(self, request: Request, tail: RadixNode) -> None:
        """The request's page after its shared ones starts as a copy of `tail`'s first page, in every
        KV group; then the hold on `tail` ends."""
        assert self.copy_page is not None
        k = request.num_tree_pages
        self.copy_page(tail.pages[0], request.pages[k])
        for src, mine in zip((pages[0] for pages in tail.window), request.window_pages or []):
            self.copy_page(src, mine[k])
        self._let_go(tail)

    def drop_tail(self, request: Request, tail: RadixNode) -> None:
        """Gives up the partial page: its hold ends and its tokens count as not computed. For a request
        that finds no room while holding it: the hold may be what keeps the pages it needs from eviction."""
        self._let_go(tail)
        request.num_computed_tokens = request.num_tree_pages * self.pool.page_size

    def undo(self, request: Request, tail: RadixNode | None) -> None:
        """Undoes `start` for a request that could not be admitted after all."""
        if tail is not None:
            self._let_go(tail)
        self.cache.unlock(request.tree_node)
        request.tree_node = None
        request.pages = []
        request.num_tree_pages = 0
        request.num_computed_tokens = 0
        if self.windows is not None:
            self.windows.forget(request)

    def _whole_pages(self, request: Request) -> PrefixMatch:
        size = self.pool.page_size
        limit = (request.num_tokens - 1) // size * size
        match = self.cache.match(request.all_token_ids[:limit], request.cache_salt)
        if self.offload is not None and limit:  # pages past the tree's match may still be on disk
            match = self.offload.extend(self.cache, match, request.all_token_ids[:limit], request.cache_salt,
                                        self.make_room)
        if self.windows is not None:
            usable = self.windows.usable_prefix(match.window, match.num_pages)
            if usable < match.num_pages:  # the sliding groups lack the window before the match's end
                match = self.cache.match(request.all_token_ids[: usable * size], request.cache_salt) \
                    if usable else PrefixMatch(None, [])
        if match.num_pages == 0:
            return match
        self.cache.lock(match.node)
        if self.windows is not None:
            self.windows.adopt_match(request, match.window, match.num_pages)
        request.tree_node = match.node
        request.pages = list(match.pages)
        request.num_tree_pages = match.num_pages
        request.num_computed_tokens = match.num_pages * size
        return match

    def _partial_page(self, request: Request, match: PrefixMatch) -> RadixNode | None:
        if self.copy_page is None:
            return None
        start = request.num_computed_tokens
        ahead = request.all_token_ids[start : min(start + self.pool.page_size, request.num_tokens - 1)]
        found = self.cache.partial_page(match, ahead)
        if found is None:
            return None
        node, n = found
        window = [pages[0] for pages in node.window]  # [] without sliding groups
        if None in window:
            return None  # the window before the match's end is the match's; this page's must be there too
        self.cache.ref_window(window)
        self.cache.lock(node)
        request.num_computed_tokens += n
        return node

    def _let_go(self, tail: RadixNode) -> None:
        self.cache.unref_window(pages[0] for pages in tail.window)
        self.cache.unlock(tail)
