"""The prefix cache: a radix tree over token ids whose nodes own KV pages.

Keys are page-aligned: every edge holds a whole number of pages (`len(key) == len(pages) * page_size`)
and a node's children are keyed by the first page of their edge, so two children never start with
the same page and a lookup costs one dict probe plus one comparison per page.

Ownership. A page in the tree belongs to the tree alone; a running request that uses a cached prefix
holds a *lock* on the node where its prefix ends, and `lock_ref` counts, on every node, the requests
whose locked node lies at or below it (so `lock_ref(parent) >= lock_ref(child)`, and an unlocked
node's whole subtree is unlocked). Locked nodes are never evicted and never trimmed.

Namespaces. Each `cache_salt` has its own root (None is the shared default), so requests with
different salts can never match each other's KV, whatever their tokens.

Sliding-window KV groups (hybrid models, engine/window_groups.py). A node also holds, per sliding
group, one entry per page of its edge: that group's page for those positions, or None where the tree
has none (requests free sliding pages that leave their window, so they hand the tree only the
window before their prompt's end and their last window). `len(pages) + window entries that are not
None` is what a node owns. Locks protect a path's full pages only: a sliding page is protected while
a running request uses it (`ref_window`), since a lock on a long path would otherwise pin every
window cached along it. `evict` takes unlocked leaves first, then the sliding pages nobody uses on
locked paths (they only serve a match ending exactly there). Which matches a sliding group can serve
is the scheduler's rule.

Eviction frees unlocked leaves in least-recently-used order; a leaf longer than needed loses only
its tail pages (the deepest positions, the least likely to be matched again), and a parent that
becomes an unlocked leaf joins the candidates. Recency is a logical clock, touched on every node of
a matched or inserted path, so a parent is never older than its children.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from tokenmill.kvcache.page_pool import PagePool
from tokenmill.kvcache.radix_node import PrefixMatch, RadixNode, SharedPrefix


class RadixCache:
    # Bounds shared_prefixes' walk (~1 ms): past it the answer covers the nodes seen so far.
    SUMMARY_MAX_NODES = 4096

    def __init__(self, pool: PagePool, num_window_groups: int = 0) -> None:
        self.pool = pool
        self.num_window_groups = num_window_groups
        self.page_size = pool.page_size
        self._roots: dict[str | None, RadixNode] = {}
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the tree owns
        self.num_locked_pages = 0  # of those, full pages on a path some running request holds
        self.num_window_pages = 0  # of those, sliding-group pages
        self._window_refs: Counter[int] = Counter()  # sliding pages running requests use: uses
        self.num_evicted_pages = 0
        # Called with (tokens, salt, first page index, pages) whenever the tree takes new pages: the
        # disk tier's write-through (engine/kv_offload.py). None: nobody listens.
        self.on_insert: Callable[[list[int], str | None, int, list[int]], None] | None = None

    @property
    def num_evictable_pages(self) -> int:
        return self.num_pages - self.num_locked_pages - len(self._window_refs)

    # ---- sliding pages in use ------------------------------------------------------------------
    def ref_window(self, pages: Iterable[int]) -> None:
        """A running request uses these sliding pages of the tree: they are not evicted meanwhile."""
        self._window_refs.update(pages)

    def unref_window(self, pages: Iterable[int]) -> None:
        for page in pages:
            if self._window_refs[page] <= 0:
                raise RuntimeError(f"unref of sliding page {page}, which no request uses")
            self._window_refs[page] -= 1
            if not self._window_refs[page]:
                del self._window_refs[page]

    # ---- lookup and insertion --------------------------------------------------------------------
    def match(self, tokens: list[int], salt: str | None = None) -> PrefixMatch:
        """The longest cached page-aligned prefix of `tokens` (whose length must be page-aligned).

        A match that ends inside an edge splits it there, so the returned node is exactly the end of
        the prefix and a lock on it protects precisely the pages the caller uses.
        """
        self._check_aligned(tokens)
        root = self._roots.get(salt)
        if root is None:
            return PrefixMatch(None, [])
        now = next(self._clock)
        node, pos, pages = root, 0, []
        window: list[list[int | None]] = [[] for _ in range(self.num_window_groups)]
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            for mine, theirs in zip(window, child.window):
                mine.extend(theirs)
            pos += n * self.page_size
            node = child
        return PrefixMatch(node, pages, window)

    def partial_page(self, match: PrefixMatch, tokens: list[int]) -> tuple[RadixNode, int] | None:
        """The cached page that continues `match` furthest into `tokens` (the tokens after the match,
        at most a page): the child of the match's end whose first page starts with the most of them,
        and how many (at least one). None when no child starts with the first of them. It scans the
        children: a handful where prompts share a system prompt, one per prompt under a bare root.

        The tree shares whole pages only; a caller that wants those tokens' K/V copies the page
        (child.pages[0]) into a page of its own, locking the child until it has. A child of several
        pages is split after its first, as `match` splits: the lock then holds that page alone (on the
        whole edge it kept a long cached prompt from eviction, and a request sharing only its first
        tokens could wait forever for pages only that eviction would free).
        """
        if match.node is None or not tokens:
            return None
        best, best_n = None, 0
        for child in match.node.children.values():
            if child.key[0] != tokens[0]:
                continue
            n = 1
            while n < len(tokens) and child.key[n] == tokens[n]:
                n += 1
            if n > best_n:
                best, best_n = child, n
                if n == len(tokens):
                    break
        if best is not None and len(best.pages) > 1:
            best = self._split(best, 1)
        return (best, best_n) if best is not None else None

    def insert(self, tokens: list[int], pages: list[int], salt: str | None = None,
               window: list[list[int | None]] | None = None) -> PrefixMatch:
        """Caches `pages` as the KV of `tokens`; returns the tree's node and pages for all of `tokens`.

        Where the tree already holds a page for a position, it keeps its own: the caller compares
        the returned pages with its own and frees each of its pages that the tree did not take.
        `window` offers sliding-group pages (None: nothing offered for that position); the tree
        takes those where it has none and lists them in the result's `adopted`.
        """
        self._check_aligned(tokens)
        if len(pages) * self.page_size != len(tokens):
            raise ValueError(f"{len(tokens)} tokens need {len(tokens) // self.page_size} pages, got {len(pages)}")
        if window is None:
            window = [[None] * len(pages) for _ in range(self.num_window_groups)]
        if len(window) != self.num_window_groups or any(len(w) != len(pages) for w in window):
            raise ValueError(f"insert needs {self.num_window_groups} sliding-group page lists of {len(pages)}")
        adopted: set[int] = set()
        held: list[list[int | None]] = [[] for _ in range(self.num_window_groups)]  # the tree's, after
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = RadixNode([], [], None, 0)
        now = next(self._clock)
        node, pos, out = root, 0, []
        while pos < len(tokens):
            key = self._page_key(tokens, pos)
            child = node.children.get(key)
            first = pos // self.page_size
            if child is None:
                child = RadixNode(tokens[pos:], pages[first:], node, now, [w[first:] for w in window])
                node.children[key] = child
                self.num_pages += child.num_owned
                self.num_window_pages += child.num_window
                adopted.update(p for w in child.window for p in w if p is not None)
                out.extend(child.pages)
                for mine, theirs in zip(held, child.window):
                    mine.extend(theirs)
                if self.on_insert is not None:
                    self.on_insert(tokens, salt, first, child.pages)
                return PrefixMatch(child, out, held, adopted)
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            if window:
                self._fill_window(child, [w[first : first + n] for w in window], adopted)
            out.extend(child.pages)
            for mine, theirs in zip(held, child.window):
                mine.extend(theirs)
            pos += n * self.page_size
            node = child
        return PrefixMatch(node, out, held, adopted)

    def _fill_window(self, node: RadixNode, offered: list[list[int | None]], adopted: set[int]) -> None:
        """Takes offered sliding pages where `node` has none."""
        taken = 0
        for have, offer in zip(node.window, offered):
            for i, page in enumerate(offer):
                if page is not None and have[i] is None:
                    have[i] = page
                    adopted.add(page)
                    taken += 1
        node.num_window += taken
        self.num_pages += taken
        self.num_window_pages += taken

    # ---- locks ---------------------------------------------------------------------------------
    def lock(self, node: RadixNode | None) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self.num_locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked prefix-cache node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_locked_pages -= len(node.pages)
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` unlocked pages to the pool, LRU leaves first, then sliding pages no
        running request uses; returns how many."""
        if num_pages <= 0 or self.num_evictable_pages == 0:
            return 0
        freed = 0
        tie = itertools.count()  # heap tie-break: nodes themselves are not comparable
        heap = [(n.last_access, next(tie), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            take = min(len(node.pages), num_pages - freed)
            if take < len(node.pages):
                # Trim the tail: the node keeps its (page-aligned) head, still a valid prefix.
                victims = node.pages[-take:] + [p for w in node.window for p in w[-take:] if p is not None]
                node.pages = node.pages[:-take]
                node.key = node.key[: len(node.pages) * self.page_size]
                node.window = [w[:-take] for w in node.window]
                node.num_window = sum(p is not None for w in node.window for p in w)
            else:
                victims = node.pages + [p for w in node.window for p in w if p is not None]
                parent = node.parent
                assert parent is not None
                del parent.children[self._page_key(node.key, 0)]
                if parent.is_root:
                    if not parent.children:
                        self._drop_root(parent)
                elif not parent.children and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, next(tie), parent))
            self.pool.free(victims)
            self.num_pages -= len(victims)
            self.num_window_pages -= len(victims) - take  # `take` full pages, the rest sliding ones
            freed += len(victims)
        if freed < num_pages and self.num_window_pages:
            freed += self._evict_unused_window(num_pages - freed)
        self.num_evicted_pages += freed
        return freed

    def _evict_unused_window(self, num_pages: int) -> int:
        """Frees up to `num_pages` sliding pages on locked paths that no running request uses."""
        victims: list[int] = []
        for node in self._nodes():
            if node.lock_ref == 0 or node.num_window == 0:
                continue  # an unlocked node goes whole, with its leaf, in LRU order
            for w in node.window:
                for i, page in enumerate(w):
                    if page is not None and page not in self._window_refs and len(victims) < num_pages:
                        victims.append(page)
                        w[i] = None
                        node.num_window -= 1
        self.pool.free(victims)
        self.num_pages -= len(victims)
        self.num_window_pages -= len(victims)
        return len(victims)

    def evict_all(self) -> int:
        """Frees every unlocked page (for a cache reset, and for tests)."""
        return self.evict(self.num_evictable_pages)

    # ---- inspection ----------------------------------------------------------------------------
    def path_pages(self, node: RadixNode | None) -> list[int]:
        """The pages from the root down to `node`, in position order."""
        parts: list[list[int]] = []
        while node is not None and not node.is_root:
            parts.append(node.pages)
            node = node.parent
        return [p for part in reversed(parts) for p in part]

    def shared_prefixes(self, limit: int = 5) -> list[SharedPrefix]:
        """The `limit` longest prefixes that are shared (a branch point, or locked by >= 2 running
        requests), longest first; for the dashboard, read at the stats cadence, never per step."""
        found: list[SharedPrefix] = []
        seen = 0
        for salt, root in self._roots.items():
            stack = [(root, 0)]
            while stack and seen < self.SUMMARY_MAX_NODES:
                node, depth = stack.pop()
                seen += 1
                depth += len(node.key)
                if not node.is_root and (len(node.children) >= 2 or node.lock_ref >= 2):
                    found.append(SharedPrefix(depth, node.lock_ref, len(node.children), salt is not None))
                # Most nodes are leaves, and a leaf is shared only when >= 2 requests lock it: skip
                # the others without visiting them (the walk's cost is the internal nodes).
                stack.extend((c, depth) for c in node.children.values() if c.children or c.lock_ref >= 2)
        return heapq.nlargest(limit, found, key=lambda p: (p.tokens, p.lock_ref))

    def all_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in (*n.pages, *(q for w in n.window for q in w)) if p is not None]

    def window_pages_held(self) -> list[int]:
        """Sliding-group pages the tree holds, per group (for stats)."""
        counts = [0] * self.num_window_groups
        for n in self._nodes():
            for g, w in enumerate(n.window):
                counts[g] += sum(p is not None for p in w)
        return counts

    def check_integrity(self, locked: Iterable[RadixNode | None]) -> None:
        """Structure, page counts and lock counts; `locked`: the node each running request holds."""
        expected: Counter[int] = Counter()
        for node in locked:
            while node is not None and not node.is_root:
                expected[id(node)] += 1
                node = node.parent
        seen_nodes: set[int] = set()
        pages = locked_pages = window_pages = 0
        for salt, root in self._roots.items():
            if root.key or root.pages or root.lock_ref:
                raise AssertionError(f"root of salt {salt!r} holds tokens, pages or locks")
            for node in self._subtree(root):
                for key, child in node.children.items():
                    if child.parent is not node:
                        raise AssertionError(f"{child!r} is linked under the wrong parent")
                    if key != self._page_key(child.key, 0):
                        raise AssertionError(f"{child!r} is filed under a key that is not its first page")
                if node.is_root:
                    continue
                seen_nodes.add(id(node))
                if not node.pages or len(node.key) != len(node.pages) * self.page_size:
                    raise AssertionError(f"{node!r} has {len(node.key)} tokens for {len(node.pages)} pages")
                if len(node.window) != self.num_window_groups or any(len(w) != len(node.pages) for w in node.window):
                    raise AssertionError(f"{node!r}: sliding-group entries do not match its pages")
                if node.num_window != sum(p is not None for w in node.window for p in w):
                    raise AssertionError(f"{node!r}: num_window is stale")
                if node.lock_ref != expected[id(node)]:
                    raise AssertionError(
                        f"{node!r}: lock_ref {node.lock_ref}, but {expected[id(node)]} running requests hold it"
                    )
                pages += node.num_owned
                window_pages += node.num_window
                locked_pages += len(node.pages) if node.lock_ref else 0
                if node.lock_ref == 0 and any(p in self._window_refs for w in node.window for p in w):
                    raise AssertionError(f"{node!r}: a running request uses a sliding page of an unlocked node")
        missing = set(expected) - seen_nodes
        if missing:
            raise AssertionError(f"{len(missing)} nodes locked by running requests are not in the tree")
        if window_pages != self.num_window_pages:
            raise AssertionError(f"tree holds {window_pages} sliding pages, counter says {self.num_window_pages}")
        if (pages, locked_pages) != (self.num_pages, self.num_locked_pages):
            raise AssertionError(
                f"tree holds {pages} pages ({locked_pages} locked), counters say "
                f"{self.num_pages} ({self.num_locked_pages} locked)"
            )

    def check_window_refs(self, used: Iterable[int]) -> None:
        """The sliding pages registered as in use are exactly `used` (running requests' tree pages)."""
        if Counter(used) != self._window_refs:
            raise AssertionError("the prefix tree's sliding pages in use differ from what running requests use")

    # ---- internals -----------------------------------------------------------------------------
    def _page_key(self, tokens: list[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos : pos + self.page_size])

    def _check_aligned(self, tokens: list[int]) -> None:
        if len(tokens) % self.page_size:
            raise ValueError(f"prefix-cache keys are page-aligned; got {len(tokens)} tokens (page {self.page_size})")

    def _common_pages(self, key: list[int], tokens: list[int], pos: int) -> int:
        """Whole pages `key` shares with `tokens[pos:]` (the first page is known to match)."""
        size = self.page_size
        limit = min(len(key), len(tokens) - pos) // size
        n = 1
        while n < limit and key[n * size : (n + 1) * size] == tokens[pos + n * size : pos + (n + 1) * size]:
            n += 1
        return n

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cuts `node`'s edge after `num_pages` pages; returns the new upper node."""
        parent = node.parent
        assert parent is not None
        cut = num_pages * self.page_size
        upper = RadixNode(node.key[:cut], node.pages[:num_pages], parent, node.last_access,
                          [w[:num_pages] for w in node.window])
        # Both halves lie on every path that ran through `node`, so they carry its lock count.
        upper.lock_ref = node.lock_ref
        parent.children[self._page_key(upper.key, 0)] = upper
        node.key = node.key[cut:]
        node.pages = node.pages[num_pages:]
        node.window = [w[num_pages:] for w in node.window]
        node.num_window -= upper.num_window
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    def _drop_root(self, root: RadixNode) -> None:
        # An empty namespace costs a dict entry; dropping it keeps one-off salts from accumulating.
        for salt, r in list(self._roots.items()):
            if r is root:
                del self._roots[salt]

    def _nodes(self) -> Iterator[RadixNode]:
        for root in self._roots.values():
            for node in self._subtree(root):
                if not node.is_root:
                    yield node

    @staticmethod
    def _subtree(root: RadixNode) -> Iterator[RadixNode]:
        stack = [root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
