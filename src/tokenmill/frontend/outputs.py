"""What the offline API returns, one object per prompt (vLLM-shaped, so users feel at home)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.sample.logprobs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int  # which of the prompt's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # matched stop string or stop token id
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # params.prompt_logprobs: entry i scores prompt token i given the tokens before it; entry 0 is None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Once finished: where the (first) sample spent its time inside the engine, engine/timeline.py's
    # summary: queue_time, prefill_time, first_token_latency, decode_throughput and stage events.
    metrics: dict[str, Any] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
