"""Stored responses (`store`, default true): what `previous_response_id`, GET, DELETE and
`input_items` read, kept in memory and bounded.

Bounded twice, by count and by bytes (a response's JSON size), evicting the least recently used
first: a long-running server keeps the recent conversations and never grows without limit. Each entry
belongs to the API key that created it (a hash of the token the client presented, "" when it sent
none), and every lookup is by (owner, id): one key never reads, continues or deletes another's
responses, and a wrong owner looks exactly like an unknown id (404), so ids cannot be probed.
Nothing survives a restart; an agent that needs that sends its history as `input` instead.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_BYTES = 64 * 2**20


def owner_of(token: str | None) -> str:
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was returned
    input_items: list[dict[str, Any]]  # this request's input, as items with ids
    messages: list[dict[str, Any]]  # the whole conversation through this response, as chat messages
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str, response: dict[str, Any], input_items: list[dict[str, Any]],
            messages: list[dict[str, Any]]) -> None:
        size = len(json.dumps([response, input_items, messages], ensure_ascii=False))
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere (a later lookup is a 404)
        key = (owner, response["id"])
        self._drop(key)
        self._entries[key] = StoredResponse(response, input_items, messages, size)
        self.num_bytes += size
        while len(self._entries) > self.max_responses or self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get((owner, response_id))
        if entry is not None:
            self._entries.move_to_end((owner, response_id))
        return entry

    def delete(self, owner: str, response_id: str) -> bool:
        return self._drop((owner, response_id))

    def _drop(self, key: tuple[str, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.num_bytes -= entry.size
        return True
