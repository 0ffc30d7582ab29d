"""One client request as the engine sees it: n samples of a prompt are n sequences, each an engine
request of its own (`Seq`), with the state the API process keeps while it runs (`SeqState`).

Split from tokenizer_manager.py, which routes sequences to the scheduler and their outputs back; the
serving modules build `Seq`s (child_params: sample k of n) without needing the manager itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from tokenmill.frontend.request_timelines import PromptStages
from tokenmill.sample.sampling_params import OutputKind, SamplingParams


@dataclass(frozen=True)
class Seq:
    """One engine request: a prompt and its (n=1) params. n samples of a prompt are n Seqs."""

    prompt_token_ids: list[int]
    params: SamplingParams


class SeqState:
    """What the API process tracks of one sequence while it runs: where its outputs go and when."""

    __slots__ = ("queue", "index", "arrival", "last_time", "finished", "record", "num_output_tokens", "sent",
                 "first_time", "stages")

    def __init__(self, queue: asyncio.Queue, index: int, arrival: float, record: bool,
                 stages: PromptStages | None = None) -> None:
        self.stages = stages  # when its template was rendered and it was tokenized (request_timelines.py)
        self.queue = queue
        self.index = index
        self.arrival = arrival
        self.last_time: float | None = None
        self.finished = False
        self.record = record  # health probes stay out of the latency histograms
        self.num_output_tokens = 0  # as last reported: the usage of a request ended by the server
        self.sent: float | None = None  # when the AddRequest left (template and tokenization done)
        self.first_time: float | None = None  # the first output's arrival


def child_params(params: SamplingParams, k: int, all_prompt_logprobs: bool = False) -> SamplingParams:
    """Sample k of n, as the offline API does it: seed + k, so samples differ yet stay reproducible;
    prompt logprobs belong to the prompt, so only sample 0 computes them (unless every sample needs
    its own copy, as a stream that echoes the prompt per choice does)."""
    prompt_logprobs = params.prompt_logprobs if k == 0 or all_prompt_logprobs else None
    return replace(params, n=1, seed=None if params.seed is None else params.seed + k, output_kind=OutputKind.DELTA,
                   prompt_logprobs=prompt_logprobs)
