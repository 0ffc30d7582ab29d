"""Continuous batching under one token budget, on top of a paged KV pool and a prefix cache.

Every step: running requests first (in admission order), each asking for the tokens it still lacks
(`num_tokens - num_computed_tokens`: one for a decode row, a chunk of the prompt for a prefill);
then waiting requests join while budget, sequence slots and pages allow. Chunked prefill, mixed
prefill/decode steps, prefix-cache hits and recompute after preemption all follow from that single
counter.

A waiting request is matched against the prefix cache when it is admitted (not when it is queued:
the tree changes while it waits, and a lock held in the queue would pin pages nobody computes with).
It locks the matched path and starts at `num_computed_tokens` = the matched length, and where a
cached page continues the match part way, that page is copied into its first page of its own
(engine/prefix_admission.py: a prompt sent again computes its last token only).

Requests with the same prompt (n samples of one prompt: same `prefill_group`) would all miss the
cache if admitted in the same step. So while one of them is running and has full prompt pages still
to compute, the others stay queued (requests behind them are admitted meanwhile); once its prefill
is in the tree they match it and compute only the last partial page. The prompt is prefilled once.

When pages run short the scheduler first evicts unlocked cached pages, and only then preempts the
newest running request; a preempted request's full pages go into the tree (unlocked), so the next
eviction can take them, or, if nobody needs them, its recompute is a cache hit. Admission is checked
up front (`EngineCore.add_request`), so a lone request always fits and the loop cannot deadlock.

Hybrid models (sliding-window layers beside full ones, kvcache/kv_groups.py): every page count
above is per KV group, and a request's new positions take a page in each group; `WindowGroups`
(engine/window_groups.py) frees the sliding groups' pages that leave the window and decides which
prefix-cache matches the sliding groups can serve. Models with one group never touch it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.prefix_admission import PrefixAdmission
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduling_policy import SchedulingPolicy
from tokenmill.engine.window_groups import WindowGroups
from tokenmill.kvcache.kv_groups import KVLayout
from tokenmill.kvcache.page_pool import PagePool
from tokenmill.kvcache.radix_cache import RadixCache

if TYPE_CHECKING:
    from tokenmill.engine.kv_offload import KVOffload

TREE_HOLDER = "<prefix cache>"


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens computed for it this step, draft tokens included
    # Speculative decoding: the last num_drafts of those tokens are request.spec_token_ids[:num_drafts],
    # guesses the target verifies in this step (their K/V counts as computed only once accepted).
    num_drafts: int = 0

    @property
    def samples(self) -> bool:
        # Only a chunk that reaches the end of the known tokens yields logits for a new token.
        return self.request.num_computed_tokens + self.num_tokens - self.num_drafts == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self, pool: PagePool, max_num_batched_tokens: int, max_num_seqs: int, enable_prefix_caching: bool = True,
        policy: SchedulingPolicy | None = None, layout: KVLayout | None = None,
    ) -> None:
        self.pool = pool
        self.policy = policy or SchedulingPolicy()  # the order of the queue and the running list
        self.layout = layout
        hybrid = layout is not None and layout.is_hybrid
        self.num_groups = layout.num_window_groups + 1 if layout is not None else 1
        self.cache = RadixCache(pool, self.num_groups - 1) if enable_prefix_caching else None
        # Sliding groups' pages (hybrid models only); every new position takes one page per group.
        self.windows = WindowGroups(layout, pool, self.cache) if hybrid and layout is not None else None
        # Admission against the cache (engine/prefix_admission.py); None with the cache off.
        self.prefix = PrefixAdmission(self.cache, pool, self.windows, self._make_room) if self.cache is not None else None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Prefix-cache counters over first admissions (prompt tokens looked up / found).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def offload(self) -> KVOffload | None:
        """The prefix cache's disk tier, when the engine has one (set on `prefix`)."""
        return self.prefix.offload if self.prefix is not None else None

    @property
    def capacity_tokens(self) -> int:
        """The longest request (prompt + output) the pool holds on its own, all KV groups counted."""
        layout = self.layout or KVLayout.single(1)
        return layout.capacity_tokens(self.pool.num_pages, self.pool.page_size, self.max_num_batched_tokens)

    @property
    def capacity_note(self) -> str:
        """Why capacity_tokens is less than the pool's slots ("" where it is not: one KV group)."""
        layout = self.layout or KVLayout.single(1)
        return layout.capacity_note(self.pool.num_pages, self.pool.page_size, self.max_num_batched_tokens)

    def add(self, request: Request) -> None:
        self.policy.enqueue(self.waiting, request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        displaced = self._displace_for_waiting(out) if self.policy.displaces else 0
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self.windows is not None:
                self.windows.slide(request)  # pages that left the window pay for this step's
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts_that_fit(request, n, budget)
            if not self._reserve(request, n + drafts, out):
                break  # `request` itself was preempted; everything after it already was
            out.chunks.append(ScheduledChunk(request, n + drafts, drafts))
            budget -= n + drafts
            i += 1
        prefilling = self._prefilling_groups()
        deferred: list[Request] = []
        # After a preemption memory is short: admitting more would only preempt again.
        while len(out.preempted) == displaced and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            first_admission = request.status == RequestStatus.WAITING
            if first_admission and self._defer(request, prefilling):
                # Its prompt is being computed by a sibling: admit it once that prefill is in the
                # tree. The requests behind it need not wait for that.
                deferred.append(self.waiting.popleft())
                continue
            tail = self.prefix.start(request) if self.prefix is not None else None
            n, need = self._first_chunk(request, budget)
            if tail is not None and self.prefix is not None and not self._make_room(need * self.num_groups):
                self.prefix.drop_tail(request, tail)  # without the partial page's hold, then
                tail = None
                n, need = self._first_chunk(request, budget)
            if not self._make_room(need * self.num_groups):
                if self.prefix is not None:
                    self.prefix.undo(request, tail)
                break
            self._allocate(request, need)
            if self.prefix is not None and tail is not None:
                self.prefix.copy_tail(request, tail)
            self.waiting.popleft()
            if request.prefill_group is not None and self.cache is not None and self._shares_later(request):
                prefilling.add(request.prefill_group)
            request.move_to(RequestStatus.RUNNING)
            request.timeline.add("scheduled", tokens=request.num_computed_tokens)  # tokens: cache hits
            self.policy.admit(self.running, request)
            if first_admission:
                request.num_cached_tokens = request.num_computed_tokens
                if self.cache is not None:
                    self.prefix_query_tokens += request.num_prompt_tokens
                    self.prefix_hit_tokens += request.num_computed_tokens
            out.chunks.append(ScheduledChunk(request, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # back at the front, in their order
        return out

    def _displace_for_waiting(self, out: SchedulerOutput) -> int:
        """Preempts running requests that the head of the queue outranks while it could not be admitted
        (no sequence slot, or its first chunk's pages not to be had); returns how many."""
        count = 0
        while self.waiting and self.running and self.policy.outranks(self.waiting[0], self.running[-1]):
            head = self.waiting[0]
            first_chunk = min(head.num_tokens - head.num_computed_tokens, self.max_num_batched_tokens)
            evictable = self.cache.num_evictable_pages if self.cache is not None else 0
            need = self.pool.pages_for(first_chunk) * self.num_groups
            if len(self.running) < self.max_num_seqs and need <= self.pool.num_free + evictable:
                break
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            count += 1
        return count

    def _prefilling_groups(self) -> set[int]:
        """Prefill groups with a running member whose shareable prompt pages are not all in the tree
        yet (a chunk publishes its full pages after the step that computes it)."""
        if self.cache is None:
            return set()
        return {r.prefill_group for r in self.running if r.prefill_group is not None and self._shares_later(r)}

    def _shares_later(self, request: Request) -> bool:
        return request.num_computed_tokens < self._shareable(request)

    def _shareable(self, request: Request) -> int:
        # The full prompt pages a sibling could match (the last token is always recomputed).
        return (request.num_prompt_tokens - 1) // self.pool.page_size * self.pool.page_size

    def _defer(self, request: Request, prefilling: set[int]) -> bool:
        # A request that needs prompt logprobs computes its whole prompt anyway: no point waiting.
        return request.prefill_group in prefilling and not request.needs_prompt_logits

    def _drafts_that_fit(self, request: Request, n: int, budget: int) -> int:
        """How many of a decoding request's draft tokens join its row: as many as the budget leaves,
        and none when their pages would need a preemption (drafts are a bet, not a need)."""
        if n != 1 or not request.spec_token_ids:
            return 0
        drafts = min(len(request.spec_token_ids), budget - 1)
        need = self.pool.pages_for(request.num_computed_tokens + 1 + drafts) - len(request.pages)
        return drafts if self._make_room(need * self.num_groups) else 0

    def trim_pages(self, request: Request) -> None:
        """Returns the pages past a running request's known tokens (left by rejected drafts) to the pool."""
        keep = self.pool.pages_for(request.num_tokens)
        if len(request.pages) > keep:
            if keep < request.num_tree_pages:
                raise AssertionError(f"request {request.request_id!r}: trimming would drop prefix-tree pages")
            self.pool.free(request.pages[keep:])
            del request.pages[keep:]
            if self.windows is not None:
                self.windows.trim(request, keep)

    def _reserve(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Pages for `n` more tokens of `request`, evicting, then preempting the newest requests."""
        need = self.pool.pages_for(request.num_computed_tokens + n) - len(request.pages)
        while not self._make_room(need * self.num_groups):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        if need > 0:
            self._allocate(request, need)
        return True

    def _allocate(self, request: Request, need: int) -> None:
        """`need` more positions' pages, in every group (the caller made room for them all)."""
        request.pages.extend(self.pool.allocate(need))
        if self.windows is not None:
            self.windows.extend(request, need)

    def _first_chunk(self, request: Request, budget: int) -> tuple[int, int]:
        """The tokens of a waiting request's first chunk under `budget`, and the pages they need."""
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        return n, self.pool.pages_for(request.num_computed_tokens + n) - len(request.pages)

    def _make_room(self, need: int) -> bool:
        """Whether `need` pages are free, evicting unlocked cached pages if that makes it so."""
        short = need - self.pool.num_free
        if short <= 0:
            return True
        if self.cache is None or self.cache.num_evictable_pages < short:
            return False  # evicting without reaching `need` would throw cache away for nothing
        self.cache.evict(short)
        return True

    # ---- prefix cache: pages into the tree ----------------------------------------------------
    def cache_computed(self, request: Request, final: bool = False) -> set[int]:
        """Hands the full computed pages of a running request to the tree, which then owns them.

        Called after prefill chunks (so requests admitted later share a prompt that is still being
        decoded) and on release. Where the tree already had a page for a position (another request
        computed the same tokens first), the request switches to the tree's page and frees its own
        copy: same tokens at the same positions, so the same K/V.

        Sliding groups' pages are offered only when `final` (at release: the request no longer
        needs them, and they are its last window); returns those the tree adopted.
        """
        if self.cache is None or not request.holds_kv or not request.uses_prefix_cache:
            return set()  # an embedding request's K/V goes back to the pool (engine/pooling.py says why)
        num_full = request.num_computed_tokens // self.pool.page_size
        offer = final and self.windows is not None and num_full > 0
        if num_full <= request.num_tree_pages and not offer:
            return set()
        mine = request.pages[:num_full]
        window = self.windows.offer(request, num_full) if offer and self.windows is not None else None
        match = self.cache.insert(request.all_token_ids[: num_full * self.pool.page_size], mine, request.cache_salt,
                                  window)
        if match.pages[: request.num_tree_pages] != mine[: request.num_tree_pages]:
            raise AssertionError(f"request {request.request_id!r}: its locked prefix changed pages in the tree")
        dropped = [p for p, t in zip(mine, match.pages) if p != t]
        request.pages[:num_full] = match.pages
        # Lock the new end before unlocking the old one: the shared path never looks unlocked.
        self.cache.lock(match.node)
        self.cache.unlock(request.tree_node)
        request.tree_node = match.node
        request.num_tree_pages = num_full
        self.pool.free(dropped)
        if self.windows is not None and not final:
            self._publish_prompt_window(request)
        return match.adopted

    def _publish_prompt_window(self, request: Request) -> None:
        """Once a hybrid request's prompt is computed, hands the tree its sliding pages for the window
        before the prompt's last full page, where the same prompt sent again (or its n samples) is
        matched; without them such a match would be cut to nothing. The request keeps using them."""
        assert self.cache is not None and self.windows is not None
        k = self._shareable(request) // self.pool.page_size
        if k == 0 or request.num_shared_window_pages >= k or request.num_computed_tokens < k * self.pool.page_size:
            return
        offer = self.windows.prompt_window_offer(request, k)
        if offer is None:
            return  # the window already slid past part of it: nothing a match could use
        tokens = request.all_token_ids[: k * self.pool.page_size]
        match = self.cache.insert(tokens, request.pages[:k], request.cache_salt, offer)
        self.windows.share_window(request, k, match.window, match.adopted)

    def _release(self, request: Request, status: RequestStatus) -> None:
        """Moves a running request out of RUNNING and disposes of its KV: full computed pages to
        the tree (when caching), the lock released, everything else back to the pool."""
        adopted = self.cache_computed(request, final=True)
        request.move_to(status)  # raises on a second release: the request is no longer RUNNING
        if self.cache is not None:
            self.cache.unlock(request.tree_node)
        if self.windows is not None:
            self.windows.release(request, adopted)
        own = request.pages[request.num_tree_pages :]
        request.pages = []
        request.num_tree_pages = 0
        request.tree_node = None
        self.pool.free(own)

    def _preempt(self, request: Request) -> None:
        self._release(request, RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.timeline.add("preempted")
        self.policy.requeue(self.waiting, request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request wherever it is (running or waiting) and returns its KV at once.

        Finished, stopped and aborted requests alike leave their full computed pages in the tree:
        the engine is synchronous, so all of them hold K/V that is complete and correct for its
        tokens (an abort never lands mid-step), and a retried request can reuse them.
        """
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        if not request.status.finished:
            request.timeline.add("finished", reason=status.value)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request, status)
        elif request.status.finished:
            request.move_to(status)  # raises: a request ends (and releases its KV) once
        else:
            self.waiting.remove(request)
            request.move_to(status)  # raises if it already finished

    # ---- accounting --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every page is free, owned by exactly one running request, or owned by the tree; lock
        counts equal the running requests holding each path; waiting requests hold nothing."""
        owned: dict[str, list[int]] = {}
        for r in self.running:
            if r.status != RequestStatus.RUNNING:
                raise AssertionError(f"request {r.request_id!r} is in the running list as {r.status.name}")
            owned[r.request_id] = r.pages[r.num_tree_pages :]
            if self.windows is not None:
                self.windows.check(r)
                owned[r.request_id + " (sliding groups)"] = self.windows.private(r)
            if self.cache is not None and r.pages[: r.num_tree_pages] != self.cache.path_pages(r.tree_node):
                raise AssertionError(f"request {r.request_id!r}: its prefix pages differ from its tree path")
            if r.num_computed_tokens < r.num_tree_pages * self.pool.page_size:
                raise AssertionError(f"request {r.request_id!r} uses cached pages it has not counted as computed")
        for r in self.waiting:
            if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise AssertionError(f"request {r.request_id!r} is in the waiting queue as {r.status.name}")
            if r.pages or r.window_pages or r.tree_node is not None or r.num_computed_tokens:
                raise AssertionError(f"waiting request {r.request_id!r} holds KV")
        if self.cache is not None:
            self.cache.check_integrity(r.tree_node for r in self.running)
            if self.windows is not None:
                self.cache.check_window_refs(p for r in self.running for p in self.windows.shared_in_use(r))
            owned[TREE_HOLDER] = self.cache.all_pages()
        self.pool.check_integrity(owned)

    def pages_in_use_by_group(self) -> list[int]:
        """Pages private to running requests, per KV group (group 0 first)."""
        counts = [sum(len(r.pages) - r.num_tree_pages for r in self.running)]
        if self.windows is not None:
            for g in range(self.windows.count):
                counts.append(sum(p is not None for r in self.running if r.window_pages
                                  for p in r.window_pages[g][r.num_shared_window_pages :]))
        return counts

    @property
    def num_cached_pages(self) -> int:
        return self.cache.num_pages if self.cache is not None else 0
