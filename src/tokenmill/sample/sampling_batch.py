"""What the sampler needs to know about the rows of one step, and a cheap plan of what to do with them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.sample.sampling_params import SamplingParams

# Temperatures below this are greedy, as in vLLM: dividing logits by ~0 would overflow to inf/NaN,
# and the limit of softmax(l / t) as t -> 0 is the argmax anyway.
GREEDY_EPS = 1e-5


@dataclass
class SamplingBatch:
    params: list[SamplingParams]  # one per logits row
    # A seeded row's generator (the engine's: keyed by seed and output position, position_seeds.py);
    # None: drawn from the sampler's engine generator.
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]  # per row
    output_token_ids: list[list[int]]  # per row: tokens generated BEFORE this step
    # Per row: the request's grammar matcher (sample/grammar.py) or None for a free row; None for the
    # whole field when no row is constrained (callers without structured output need not know it).
    matchers: Sequence[Any | None] | None = None

    def __len__(self) -> int:
        return len(self.params)


@dataclass
class BatchPlan:
    """Row indices by kind; built in one Python pass so the all-greedy step costs nearly nothing."""

    greedy: list[int]
    random: list[int]
    min_tokens: list[int]  # rows whose EOS / stop ids are still masked
    bad_words: list[int]
    logit_bias: list[int]
    penalties: list[int]
    logprobs: list[int]
    constrained: list[int]  # rows with a grammar matcher

    @property
    def needs_processing(self) -> bool:
        return bool(self.min_tokens or self.bad_words or self.logit_bias or self.penalties or self.constrained)


def plan_batch(batch: SamplingBatch) -> BatchPlan:
    plan = BatchPlan([], [], [], [], [], [], [], [])
    if batch.matchers is not None:
        plan.constrained = [i for i, m in enumerate(batch.matchers) if m is not None]
    for i, p in enumerate(batch.params):
        (plan.greedy if p.temperature < GREEDY_EPS else plan.random).append(i)
        if p.min_tokens and len(batch.output_token_ids[i]) < p.min_tokens:
            plan.min_tokens.append(i)
        if p.bad_words_token_ids:
            plan.bad_words.append(i)
        if p.logit_bias:
            plan.logit_bias.append(i)
        if has_penalties(p):
            plan.penalties.append(i)
        if p.logprobs is not None:
            plan.logprobs.append(i)
    return plan


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
