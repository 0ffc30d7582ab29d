"""The prefix cache's disk tier wired to the engine: pages out when the tree takes them, back in on a match.

Write through: every page the radix tree takes (a prefill chunk's full pages, a finished request's)
is copied out of the pool and queued for the disk tier's writer thread; a page the tier already holds
is not copied again. So eviction needs no I/O, and what the server computed is on disk when it restarts.

Read back: when a request's prefix match in the tree ends, the following whole pages of its prompt
are looked up on disk by key; each one found is read (checksummed), written into a fresh pool page
and inserted into the tree, as if a request had just computed it. The first page that is missing or
fails its check ends the disk match, and the rest is computed as usual: a bad file costs time, never
correctness.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tokenmill.kvcache.disk_tier import DiskTier
from tokenmill.kvcache.page_keys import chain_seed, page_keys
from tokenmill.kvcache.page_pool import PagePool
from tokenmill.kvcache.radix_cache import RadixCache
from tokenmill.kvcache.radix_node import PrefixMatch
from tokenmill.model.gguf_parts import all_parts

# Bytes of the model file hashed into its identity: its head (header and metadata) and tail.
_IDENTITY_SAMPLE = 4 << 20
# Pages read back are written into the pool this many at a time: one copy per cache tensor and batch
# (the runner's write_pages), with at most this many payloads held (~24 MB on the bundled model).
WRITE_BATCH = 64


class PageIO(Protocol):
    """What the runner offers: a page's K/V of every layer as bytes, and back."""

    def page_layout(self) -> tuple[str, int]: ...
    def read_page(self, page: int) -> bytes: ...
    def write_pages(self, pages: list[int], payloads: list[bytes]) -> None: ...


class KVOffload:
    def __init__(self, tier: DiskTier, runner: PageIO, pool: PagePool, identity: str) -> None:
        self.tier = tier
        self.runner = runner
        self.pool = pool
        self.identity = identity
        self.page_size = pool.page_size
        self.hit_pages = 0  # pages read back from disk into the pool
        self._seeds: dict[str | None, bytes] = {}

    def _seed(self, salt: str | None) -> bytes:
        seed = self._seeds.get(salt)
        if seed is None:
            seed = self._seeds[salt] = chain_seed(self.identity, salt)
        return seed

    # ---- write through ---------------------------------------------------------------------------
    def on_insert(self, tokens: list[int], salt: str | None, first_page: int, pages: list[int]) -> None:
        """The tree took `pages`, the KV of tokens[first_page * page_size:]."""
        keys = page_keys(self._seed(salt), tokens, self.page_size)
        for index, key in enumerate(keys):
            if index >= first_page and not self.tier.contains(key):
                self.tier.put(key, self.runner.read_page(pages[index - first_page]))

    # ---- read back -------------------------------------------------------------------------------
    def extend(self, cache: RadixCache, match: PrefixMatch, tokens: list[int], salt: str | None,
               make_room: Callable[[int], bool]) -> PrefixMatch:
        """`match` (the tree's, for page-aligned `tokens`) extended by the pages found on disk."""
        have = match.num_pages
        keys = list(page_keys(self._seed(salt), tokens, self.page_size))[have:]
        if not keys or not self.tier.contains(keys[0]):
            return match
        loaded: list[int] = []
        batch: list[bytes] = []
        cache.lock(match.node)  # making room must not evict the prefix being extended
        try:
            for payload in self.tier.get_many(keys):
                if payload is None or not make_room(1):
                    break
                loaded.extend(self.pool.allocate(1))
                batch.append(payload)
                if len(batch) == WRITE_BATCH:
                    self.runner.write_pages(loaded[-len(batch):], batch)
                    batch = []
            if batch:
                self.runner.write_pages(loaded[-len(batch):], batch)
        finally:
            cache.unlock(match.node)
        if not loaded:
            return match
        self.hit_pages += len(loaded)
        end = (have + len(loaded)) * self.page_size
        return cache.insert(tokens[:end], match.pages + loaded, salt)

    def stats(self) -> dict[str, int]:
        s = self.tier.stats
        return {
            "kv_disk_pages": s.pages,
            "kv_disk_bytes": s.bytes,
            "kv_disk_hit_pages_total": self.hit_pages,
            "kv_disk_written_pages_total": s.writes,
            "kv_disk_faults_total": s.faults,
            "kv_disk_write_errors_total": s.write_errors,
        }

    def close(self) -> None:
        self.tier.close()


def model_identity(path: str, settings: dict[str, Any]) -> str:
    """What makes two engines' KV interchangeable: the model's bytes (sampled: size, head and tail of
    each file, so a copy or a rename keeps the identity and a re-quantized file does not) and the
    settings that change the numbers (precision, quantization, ...)."""
    root = Path(path)
    # a folder's files, or a GGUF's parts (one for a whole file, every part of a split model)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [Path(p) for p in all_parts(path)]
    h = hashlib.blake2b(digest_size=16)
    for i, file in enumerate(files):
        size = file.stat().st_size
        label = file.relative_to(root) if root.is_dir() else (f"part {i + 1}" if i else "")
        h.update(f"{label}:{size};".encode())
        with open(file, "rb") as f:
            h.update(f.read(_IDENTITY_SAMPLE))
            if size > 2 * _IDENTITY_SAMPLE:
                f.seek(size - _IDENTITY_SAMPLE)
                h.update(f.read(_IDENTITY_SAMPLE))
    h.update(repr(sorted(settings.items())).encode())
    return h.hexdigest()


def build_offload(folder: str, max_bytes: int, runner: PageIO, pool: PagePool, model_path: str,
                  settings: dict[str, Any]) -> KVOffload:
    layout, page_bytes = runner.page_layout()
    identity = model_identity(model_path, {**settings, "layout": layout, "page_size": pool.page_size})
    # One sub-folder per identity: another model's pages neither count against this bound nor match.
    tier = DiskTier(os.path.join(folder, identity), max_bytes, layout, page_bytes)
    return KVOffload(tier, runner, pool, identity)
