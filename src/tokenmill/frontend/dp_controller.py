"""Data-parallel routing policies: which replica (a whole engine with its own KV pool) gets a request.

Pure functions of what the caller knows (the prompt, its cache salt, each replica's load); no sockets,
no clock, so each policy is unit-tested alone. The wiring (sockets, liveness, load bookkeeping) is
frontend/dp_router.py. Policies, chosen with `--load-balance-method`:

- round_robin: the live replicas in turn.
- least_requests: the fewest unfinished requests (the router counts them exactly).
- least_tokens: the fewest queued + running tokens (the replica's last SchedulerStats plus the prompt
  tokens routed to it since; SGLang's total_tokens).
- prefix_aware: the replica whose prefix cache most likely holds the longest prefix of the prompt,
  judged from an approximate tree of the prompts routed to each replica (SGLang's router keeps such an
  approximate tree rather than asking the engines); load decides when nothing matches, on ties, and when
  the replicas are too unbalanced for cache hits to be worth it.
"""

from __future__ import annotations

import array
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenmill.config import LOAD_BALANCE_METHODS


@dataclass(frozen=True)
class ReplicaLoad:
    """What a policy may know about one replica."""

    index: int
    live: bool
    num_requests: int  # unfinished requests routed there
    num_tokens: int  # queued + running tokens (estimate)


class Policy(Protocol):
    def choose(self, prompt: Sequence[int], salt: str | None, loads: Sequence[ReplicaLoad]) -> int:
        """The index of a live replica (the caller guarantees at least one is live)."""
        ...


def _live(loads: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    live = [r for r in loads if r.live]
    if not live:
        raise ValueError("no live replica to route to")
    return live


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, prompt: Sequence[int], salt: str | None, loads: Sequence[ReplicaLoad]) -> int:
        live = _live(loads)
        return live[next(self._counter) % len(live)].index


class LeastRequests:
    def choose(self, prompt: Sequence[int], salt: str | None, loads: Sequence[ReplicaLoad]) -> int:
        # Ties go to the lower index: deterministic, and an idle server keeps using replica 0's cache.
        return min(_live(loads), key=lambda r: (r.num_requests, r.num_tokens, r.index)).index


class LeastTokens:
    def choose(self, prompt: Sequence[int], salt: str | None, loads: Sequence[ReplicaLoad]) -> int:
        return min(_live(loads), key=lambda r: (r.num_tokens, r.num_requests, r.index)).index


class PrefixTree:
    """An approximate radix tree of the token prefixes routed to one replica, at page granularity.

    A node is one block of `block_size` tokens, named by a hash chained over the salt and every block
    before it, so a node stands for the whole prefix up to its end (as a trie path does) and different
    salts never meet. Nodes live in one LRU map bounded by `max_nodes`; a routed prompt touches its
    nodes leaf first, so a parent is always at least as recent as its children and eviction takes
    leaves before the prefixes they hang from. "Approximate": the replica's own cache may already have
    evicted what this tree remembers, or hold prefixes this tree forgot; a wrong guess costs only a
    cache miss, never a wrong answer.
    """

    def __init__(self, block_size: int = 16, max_nodes: int = 65536) -> None:
        self.block_size = block_size
        self.max_nodes = max_nodes
        self._nodes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._nodes)

    def _keys(self, prompt: Sequence[int], salt: str | None) -> list[bytes]:
        # The salt opens the chain: a request without one and every salted tenant are disjoint trees.
        key = hashlib.blake2b(b"\x00" if salt is None else b"\x01" + salt.encode(), digest_size=16).digest()
        data = array.array("I", prompt).tobytes()  # 4 bytes a token id, one pass in C
        step = 4 * self.block_size
        keys = []
        for end in range(step, len(data) + 1, step):
            key = hashlib.blake2b(key + data[end - step: end], digest_size=16).digest()
            keys.append(key)
        return keys

    def match(self, prompt: Sequence[int], salt: str | None) -> int:
        """Tokens of the prompt's longest prefix this tree holds (a multiple of block_size)."""
        matched = 0
        for key in self._keys(prompt, salt):
            if key not in self._nodes:
                break
            matched += self.block_size
        return matched

    def insert(self, prompt: Sequence[int], salt: str | None) -> None:
        for key in reversed(self._keys(prompt, salt)):
            self._nodes[key] = None
            self._nodes.move_to_end(key)
        while len(self._nodes) > self.max_nodes:
            self._nodes.popitem(last=False)


class PrefixAware:
    """SGLang's cache-aware routing: the longest approximate match wins, unless the replicas are
    unbalanced (the busiest has `balance_abs` more requests than the idlest and `balance_rel` times as
    many), where a cache hit would not repay the wait; no match at all goes to the least loaded."""

    def __init__(self, num_replicas: int, block_size: int = 16, max_nodes: int = 65536,
                 balance_abs: int = 8, balance_rel: float = 1.5) -> None:
        self.trees = [PrefixTree(block_size, max_nodes) for _ in range(num_replicas)]
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._fallback = LeastRequests()

    def choose(self, prompt: Sequence[int], salt: str | None, loads: Sequence[ReplicaLoad]) -> int:
        live = _live(loads)
        busiest = max(r.num_requests for r in live)
        idlest = min(r.num_requests for r in live)
        unbalanced = busiest - idlest > self.balance_abs and busiest > idlest * self.balance_rel
        chosen = self._fallback.choose(prompt, salt, live)
        if not unbalanced:
            matches = {r.index: self.trees[r.index].match(prompt, salt) for r in live}
            best = max(matches.values())
            if best > 0:
                # Among the replicas with the longest match, the least loaded.
                chosen = self._fallback.choose(prompt, salt, [r for r in live if matches[r.index] == best])
        self.trees[chosen].insert(prompt, salt)
        return chosen

    def forget(self, index: int) -> None:
        """A replica died: what its tree says is gone with its KV."""
        self.trees[index] = PrefixTree(self.trees[index].block_size, self.trees[index].max_nodes)


def make_policy(method: str, num_replicas: int, block_size: int = 16) -> Policy:
    if method == "round_robin":
        return RoundRobin()
    if method == "least_requests":
        return LeastRequests()
    if method == "least_tokens":
        return LeastTokens()
    if method == "prefix_aware":
        return PrefixAware(num_replicas, block_size)
    raise ValueError(f"load_balance_method must be one of {LOAD_BALANCE_METHODS}, got {method!r}")
