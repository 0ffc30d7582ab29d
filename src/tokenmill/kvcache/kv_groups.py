"""How a model's layers share the KV page pool: KV groups (issue 23's hybrid KV cache).

Layers are grouped by attention type. Group 0 holds the full-attention layers (every layer for a
model without sliding ones); sliding-window layers form the other groups. Each group has its own
page table per request over the one page pool, so a sliding group can give back the pages that
fall wholly out of its window while the full group keeps the whole context.

Equal-sized groups share the per-layer K/V tensors (vLLM's hybrid KV cache manager does the same):
every group has `slots_per_page` layers (the last sliding group may have fewer), layer j of every
group reads and writes tensor slot j, and a page id names the same bytes in every group. A page
therefore costs `slots_per_page` layers' rows, not `num_layers`', and it belongs to exactly one
group of one request (or the prefix tree) at a time. Gemma 3 270M: layers 5, 11, 17 are group 0,
the 15 sliding layers five groups of three; three K/V tensors in all.

This module is pure bookkeeping (no torch): the runner lays out tensors from it, the scheduler
sizes allocations and frees window pages with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]  # model layer indices, in order; layer i of this tuple uses tensor slot i
    window: int | None  # sliding window in tokens (a query at p sees p - window + 1 .. p); None: full


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]  # groups[0] attends the full context
    num_layers: int

    @classmethod
    def single(cls, num_layers: int) -> KVLayout:
        """Every layer in one full-attention group: the cache as it is for llama-style models."""
        return cls((KVGroup(tuple(range(num_layers)), None),), num_layers)

    @classmethod
    def for_layers(cls, windows: list[int | None]) -> KVLayout:
        """Groups for layers whose windows are `windows` (None: full attention).

        A model with no full layer, or whose sliding layers have several window sizes, keeps one
        group (full KV for every layer, the window applied when reading): correct, not lean; no
        model tokenmill runs has either.
        """
        full = tuple(i for i, w in enumerate(windows) if w is None)
        sliding = [i for i, w in enumerate(windows) if w is not None]
        if not full or not sliding or len({windows[i] for i in sliding}) != 1:
            return cls.single(len(windows))
        window = windows[sliding[0]]
        size = len(full)
        groups = [KVGroup(full, None)]
        groups += [KVGroup(tuple(sliding[i : i + size]), window) for i in range(0, len(sliding), size)]
        return cls(tuple(groups), len(windows))

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def num_window_groups(self) -> int:
        """Groups after group 0: each holds one page list per request of its own."""
        return len(self.groups) - 1

    @property
    def slots_per_page(self) -> int:
        """K/V tensors the runner allocates: the largest group's layer count."""
        return max(len(g.layers) for g in self.groups)

    @property
    def window(self) -> int | None:
        """The sliding groups' window (they all have the same one); None for a single group."""
        return self.groups[1].window if self.is_hybrid else None

    def placement(self) -> list[tuple[int, int]]:
        """(group, tensor slot) of every model layer, by layer index."""
        out: list[tuple[int, int]] = [(0, 0)] * self.num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                out[layer] = (g, slot)
        return out

    def window_pages(self, page_size: int, chunk_tokens: int) -> int:
        """The most pages a sliding group holds for one request during a step that computes up to
        `chunk_tokens` tokens: the window before the chunk's first query, plus the chunk."""
        assert self.window is not None
        return -(-(self.window - 1 + chunk_tokens) // page_size) + 1

    def pages_needed(self, num_tokens: int, page_size: int, chunk_tokens: int) -> int:
        """Pool pages one request of `num_tokens` tokens may hold at once, all groups together."""
        pages = -(-num_tokens // page_size)
        if not self.is_hybrid:
            return pages
        return pages + self.num_window_groups * min(pages, self.window_pages(page_size, chunk_tokens))

    def capacity_tokens(self, num_pages: int, page_size: int, chunk_tokens: int) -> int:
        """The longest request (prompt + output) a pool of `num_pages` pages holds on its own."""
        if not self.is_hybrid:
            return num_pages * page_size
        groups = 1 + self.num_window_groups
        # Either every group holds the whole (short) context, or the window groups are at their cap.
        short = min(num_pages // groups, self.window_pages(page_size, chunk_tokens)) * page_size
        long = (num_pages - self.num_window_groups * self.window_pages(page_size, chunk_tokens)) * page_size
        return max(short, long)

    def capacity_note(self, num_pages: int, page_size: int, chunk_tokens: int) -> str:
        """Why capacity_tokens is less than the pool's slots, in words for an error or a log ("" with
        one group): the sliding groups' share, and the two settings that change it."""
        if not self.is_hybrid:
            return ""
        per_request = self.window_pages(page_size, chunk_tokens) * page_size
        return (f"{num_pages * page_size} token slots shared by {len(self.groups)} KV groups, each of the "
                f"{self.num_window_groups} sliding-window ones keeping up to {per_request} of a request's "
                f"(its {self.window}-token window and a prefill chunk of {chunk_tokens}); a larger "
                "kv_cache_tokens or a smaller max_num_batched_tokens holds longer requests")
