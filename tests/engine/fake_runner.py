"""A model runner stand-in for scheduler/engine tests: no tensors of weights, but real paging.

It stores each computed token id in the page slots the engine assigned, and checks on every step
that the slots of a sequence's already-computed positions hold exactly that sequence's tokens. So a
scheduler bug (wrong pages, lost pages after preemption, two requests sharing a page) fails the
test. With prefix caching, a cached page is shared by every request that matched it and holds the
same tokens for all of them, so the check stays exact; on top of it, writes into a page the prefix
tree owns are refused (a request only ever computes into its own pages). Its "logits" make the next token a deterministic function of the whole cached prefix, so
outputs must not depend on batching, chunking or preemption.

With a hybrid `kv_layout` (kvcache/kv_groups.py) every sliding group writes the tokens into its own
pages too, and each sampled row checks that every sliding group still holds exactly the window of
tokens that row's query sees: a page freed too early, or a prefix hit without its window, fails.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.kvcache.kv_groups import KVLayout
from tokenmill.model.runner import SeqChunk


class FakeRunner:
    def __init__(self, num_pages: int, page_size: int, vocab_size: int, kv_layout: KVLayout | None = None) -> None:
        self.kv_layout = kv_layout
        self.window = kv_layout.window if kv_layout is not None else None
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.slots: list[int | None] = [None] * (num_pages * page_size)
        self.steps: list[list[tuple[int, int, bool]]] = []  # per step: (start, len, sample)
        self.read_only_pages: Callable[[], set[int]] | None = None  # pages no chunk may write
        self.idle_releases = 0  # times the engine, left without requests, had its idle memory dropped
        self.copies: list[tuple[int, int]] = []  # copy_page calls: (src, dst)

    def release_idle_memory(self) -> None:
        self.idle_releases += 1

    def _slot(self, pages: list[int], pos: int) -> int:
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        self.steps.append([(c.start, len(c.token_ids), c.sample) for c in chunks])
        rows = []
        frozen = self.read_only_pages() if self.read_only_pages is not None else set()
        for c in chunks:
            # A real model samples from the hidden state of the last token it computes: a chunk
            # with no tokens (a "full" prefix hit that skipped the last prompt token) has none.
            assert c.token_ids, "an empty chunk"
            groups = [c.pages] + list(c.window_pages or [])
            if self.window is not None:
                assert c.window_pages is not None and len(groups) == len(self.kv_layout.groups), "no sliding pages"
            for pages in groups:
                written = {pages[(c.start + i) // self.page_size] for i in range(len(c.token_ids))}
                assert None not in written, "a chunk writes into a page its sliding group let go"
                assert not written & frozen, f"a chunk writes into cached pages {sorted(written & frozen)}"
                for i, token in enumerate(c.token_ids):
                    self.slots[self._slot(pages, c.start + i)] = token
            end = c.start + len(c.token_ids)
            # all_logits: a row per token (prompt logprobs), else the sampling rows (the last
            # num_logits: a speculative chunk verifies its drafts with one row each).
            first = c.start + 1 if c.all_logits else end - c.num_logits + 1 if c.sample else end + 1
            ends = range(first, end + 1)
            for e in ends:
                prefix = [self.slots[self._slot(c.pages, p)] for p in range(e)]
                assert None not in prefix, "read a slot that was never written"
                for pages in groups[1:]:  # the query at e - 1 sees e - window .. e - 1
                    lo = max(0, e - self.window)
                    assert [self.slots[self._slot(pages, p)] for p in range(lo, e)] == prefix[lo:], \
                        "a sliding group lost part of its window"
                rows.append(next_token(prefix, self.vocab_size))
        logits = torch.full((len(rows), self.vocab_size), -10.0)
        if rows:
            logits[torch.arange(len(rows)), torch.tensor(rows)] = 10.0
        return logits


    def shutdown(self) -> None:
        """Nothing to stop (the real runner stops its tensor-parallel ranks here)."""

    def copy_page(self, src: int, dst: int) -> None:
        """A page's "K/V" copied: its slots' token ids (engine/prefix_admission.py copies a cached page a
        request continues part way). The copy goes into a page the tree does not own."""
        frozen = self.read_only_pages() if self.read_only_pages is not None else set()
        assert src in frozen and dst not in frozen, f"copy of page {src} into {dst}: not from the tree into a request's"
        size = self.page_size
        self.copies.append((src, dst))
        self.slots[dst * size:(dst + 1) * size] = self.slots[src * size:(src + 1) * size]

    # ---- the disk tier's page IO: a page's "K/V" are the token ids in its slots -------------------
    def page_layout(self) -> tuple[str, int]:
        return f"int64({self.page_size},)", 8 * self.page_size

    def read_page(self, page: int) -> bytes:
        slots = self.slots[page * self.page_size:(page + 1) * self.page_size]
        return torch.tensor([-1 if t is None else t for t in slots], dtype=torch.int64).numpy().tobytes()

    def write_pages(self, pages: list[int], payloads: list[bytes]) -> None:
        for page, payload in zip(pages, payloads, strict=True):
            values = torch.frombuffer(bytearray(payload), dtype=torch.int64).tolist()
            self.slots[page * self.page_size:(page + 1) * self.page_size] = [None if t < 0 else t for t in values]


def next_token(prefix: list[int], vocab_size: int) -> int:
    h = 0
    for t in prefix:
        h = (h * 31 + t + 7) % 1_000_003
    # Never 0: token 0 plays EOS in these tests, so outputs run to max_tokens unless asked.
    return 1 + h % (vocab_size - 1)


def make_engine(vocab_size: int = 50, max_model_len: int = 4096, kv_layout: KVLayout | None = None,
                **config) -> tuple[EngineCore, FakeRunner]:
    cfg = EngineConfig(**config)
    runner = FakeRunner(cfg.num_pages, cfg.page_size, vocab_size, kv_layout)
    engine = EngineCore(cfg, runner, vocab_size, eos_token_ids=[0], max_model_len=max_model_len)
    cache = engine.scheduler.cache
    if cache is not None:
        runner.read_only_pages = lambda: set(cache.all_pages())
    return engine, runner


def reference_output(prompt: list[int], max_tokens: int, vocab_size: int = 50) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq, vocab_size))
    return seq[len(prompt):]


def run_to_completion(engine: EngineCore, check_every_step: bool = True) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if check_every_step:
            engine.check_integrity()
    return outputs
