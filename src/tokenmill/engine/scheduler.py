"""Continuous batching under one token budget.

Every step: running requests first (in admission order), each asking for the tokens it still lacks
(`num_tokens - num_computed_tokens`: one for a decode row, a chunk of the prompt for a prefill);
then waiting requests join while budget, sequence slots and pages allow. Chunked prefill, mixed
prefill/decode steps and recompute after preemption all follow from that single counter.

When the pool runs dry, the newest running request is preempted: its pages go back to the pool and
it returns to the front of the waiting queue, to recompute prompt + output so far. Admission is
checked up front (`check_fits`), so a lone request always fits and the loop cannot deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.kvcache.page_pool import PagePool


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens computed for it this step

    @property
    def samples(self) -> bool:
        # Only a chunk that reaches the end of the known tokens yields logits for a new token.
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, pool: PagePool, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, n, out):
                break  # `request` itself was preempted; everything after it already was
            out.chunks.append(ScheduledChunk(request, n))
            budget -= n
            i += 1
        # After a preemption memory is short: admitting more would only preempt again.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            need = self.pool.pages_for(request.num_computed_tokens + n) - len(request.pages)
            if need > self.pool.num_free:
                break
            request.pages.extend(self.pool.allocate(need))
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, n))
            budget -= n
        return out

    def _reserve(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Pages for `n` more tokens of `request`, preempting the newest requests if needed."""
        need = self.pool.pages_for(request.num_computed_tokens + n) - len(request.pages)
        while need > self.pool.num_free:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        if need > 0:
            request.pages.extend(self.pool.allocate(need))
        return True

    def _preempt(self, request: Request) -> None:
        self.pool.free(request.pages)
        request.pages = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request wherever it is (running or waiting) and returns its pages at once."""
        if request.status.finished:
            return  # already ended, e.g. a duplicate abort: harmless by design
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.pool.free(request.pages)
        request.pages = []
        request.status = status

    def check_integrity(self) -> None:
        owned = {r.request_id: r.pages for r in self.running}
        for r in self.waiting:
            if r.pages:
                owned[r.request_id] = r.pages
        self.pool.check_integrity(owned)
