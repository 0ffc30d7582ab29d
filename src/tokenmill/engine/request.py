"""One request's state inside the engine: its tokens, its progress counter and its KV pages."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.timeline import RequestTimeline
from tokenmill.sample.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.pooling import PooledState
    from tokenmill.kvcache.radix_node import RadixNode
    from tokenmill.sample.logprobs import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, never admitted; holds no KV
    RUNNING = "running"  # holds KV: private pages, and possibly a locked path in the prefix tree
    PREEMPTED = "preempted"  # KV given back; waits to recompute prompt + output so far
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})
# The only moves a request may make. KV is held exactly while RUNNING, so every move out of RUNNING
# is also the one place the KV is released: a second release would need a second move out of
# RUNNING, which this table refuses.
_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, *_FINISHED}),
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED, *_FINISHED}),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING, *_FINISHED}),
    **{s: frozenset() for s in _FINISHED},
}


class IllegalTransition(RuntimeError):
    """A request was moved between states in an order its lifecycle does not allow (an engine bug)."""


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what the context leaves
    cache_salt: str | None = None  # prefix-cache namespace: different salts never share KV
    counted: bool = True  # False: the server's health probe, left out of the request token counters
    output_token_ids: list[int] = field(default_factory=list)
    # The one progress counter: tokens whose K/V are in the cache. Prefill, chunked prefill, decode,
    # a prefix-cache hit and recompute after preemption are all "compute num_computed_tokens..num_tokens".
    num_computed_tokens: int = 0
    # KV pages for positions 0.. in order. The first `num_tree_pages` belong to the prefix tree (the
    # request only holds a lock on their path, `tree_node`); the rest are this request's own.
    pages: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    tree_node: RadixNode | None = None
    # Hybrid models only (engine/window_groups.py): one list per sliding KV group, as long as `pages`,
    # None where the group holds no page (wholly before its window); entries below
    # `num_shared_window_pages` are the prefix tree's, and those below `window_start` are all None.
    window_pages: list[list[int | None]] = field(default_factory=list)
    num_shared_window_pages: int = 0
    window_start: int = 0
    # Prompt tokens served from the prefix cache at first admission (what usage reports as cached).
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Requests with the same key have the same prompt and cache salt (n samples of one prompt, or
    # identical prompts sent together): the scheduler admits them one prefill at a time, so the later
    # ones find the prompt in the prefix cache instead of computing it again in the same step.
    prefill_group: int | None = None
    # params.prompt_logprobs: entry i scores prompt token i given the tokens before it; entry 0 is None
    # (nothing precedes the first token). Filled chunk by chunk during the prefill.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Speculative decoding: tokens a proposer guessed will follow all_token_ids, verified in the next
    # step and then cleared. Never part of all_token_ids, the prefix tree or any count until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # An embedding request (engine/pooling.py): prefill only, no sampling, no prefix cache; `params`
    # is then a placeholder and max_tokens 0.
    pooled: PooledState | None = None
    # prompt + output in one list, so a step can slice the tokens it computes without concatenating.
    all_token_ids: list[int] = field(init=False)
    timeline: RequestTimeline = field(init=False, repr=False)  # stage times (engine/timeline.py)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.timeline = RequestTimeline(self.arrival_time)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt positions still lack their logprobs: such a request computes its whole prompt
        (a cached prefix has K/V but no logits) and its prefill chunks return logits for every row."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def uses_prefix_cache(self) -> bool:
        return self.pooled is None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def holds_kv(self) -> bool:
        return self.status == RequestStatus.RUNNING

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.timeline.tokens_out(1)

    def move_to(self, status: RequestStatus) -> None:
        if status not in _ALLOWED[self.status]:
            raise IllegalTransition(f"request {self.request_id!r}: {self.status.name} -> {status.name} is not allowed")
        self.status = status

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
