"""Names for KV pages that outlive the pool: a chain of hashes over the tokens up to each page's end.

A page's K/V depend on every token before it, not only its own, so page i's key hashes page i-1's key
with page i's tokens (vLLM's block hashes do the same). The chain starts from a seed that holds what
else decides the contents: the model's identity, the KV layout, the page size and the cache salt, so
pages of another model, dtype or tenant never share a name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np


def chain_seed(identity: str, salt: str | None) -> bytes:
    salt_part = b"\x00" if salt is None else b"\x01" + salt.encode()
    return hashlib.blake2b(identity.encode() + b"\x00" + salt_part, digest_size=32).digest()


def page_keys(seed: bytes, tokens: list[int], page_size: int, start_page: int = 0,
              parent: bytes | None = None) -> Iterator[bytes]:
    """Keys of the whole pages of `tokens` from `start_page` on; `parent` is the key of the page before
    `start_page` (None: the chain is computed from the seed)."""
    key = seed
    first = 0
    if parent is not None and start_page > 0:
        key, first = parent, start_page
    for page in range(first, len(tokens) // page_size):
        chunk = np.asarray(tokens[page * page_size:(page + 1) * page_size], dtype=np.int64).tobytes()
        key = hashlib.blake2b(key + chunk, digest_size=32).digest()
        if page >= start_page:
            yield key
