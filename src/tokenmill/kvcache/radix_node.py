"""The prefix cache's node (kvcache/radix_cache.py explains the tree: page-aligned edges, locks,
sliding-window entries) and what its lookups return. Its own file so the tree's operations read apart
from the shapes they work on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple


class RadixNode:
    __slots__ = ("key", "pages", "window", "num_window", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], pages: list[int], parent: RadixNode | None, now: int,
                 window: list[list[int | None]] | None = None) -> None:
        self.key = key  # the tokens of the edge into this node
        self.pages = pages  # their KV pages, one per page_size tokens
        # Per sliding group, its page (or None) for each of `pages`' positions; [] without groups.
        self.window = window or []
        self.num_window = sum(p is not None for w in self.window for p in w)
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = now

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def num_owned(self) -> int:
        """Pool pages this node owns, all groups together."""
        return len(self.pages) + self.num_window

    def __repr__(self) -> str:
        return f"RadixNode(tokens={len(self.key)}, pages={self.pages}, lock_ref={self.lock_ref})"


@dataclass
class PrefixMatch:
    node: RadixNode | None  # where the match ends (a root when nothing matched; None: unknown salt)
    pages: list[int]  # the cached pages of the matched prefix, in position order
    # Per sliding group, the tree's page (or None) for each of `pages`' positions ([] without groups),
    # after the insert for insert().
    window: list[list[int | None]] = dataclasses.field(default_factory=list)
    # insert(): the offered sliding pages the tree took (the caller frees the others it owns).
    adopted: set[int] = dataclasses.field(default_factory=set)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class SharedPrefix(NamedTuple):
    """A prefix several sequences share: where cached continuations branch, or >= 2 requests lock it."""

    tokens: int  # the prefix's length (page-aligned)
    lock_ref: int  # running requests using it
    branches: int  # cached continuations below it
    salted: bool  # in a cache_salt namespace (the salt itself is a tenant's secret, never shown)
