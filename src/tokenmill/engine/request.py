"""One request's state inside the engine: its tokens, its progress counter and its KV pages."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tokenmill.sample.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # pages taken back; waits to recompute prompt + output so far
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what the context leaves
    generator: torch.Generator | None = None  # seeded requests only
    output_token_ids: list[int] = field(default_factory=list)
    # The one progress counter: tokens whose K/V are in the cache. Prefill, chunked prefill, decode
    # and recompute after preemption are all "compute tokens num_computed_tokens..num_tokens".
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # prompt + output in one list, so a step can slice the tokens it computes without concatenating.
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
