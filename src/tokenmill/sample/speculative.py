"""Verifying speculative tokens with the ordinary sampler: one row per position, then the longest run.

A request that decodes with k draft tokens d_1..d_k gets k + 1 logits rows from the target: row j
holds the target's distribution after prompt + output + d_1..d_j. Each row is sampled exactly as a
non-speculative step would sample it (every processor: grammar mask, min_tokens, bias, penalties over
output + d_1..d_j, temperature, top-k/top-p/min-p; a seeded request's draws from the generator of the
row's output position, sample/position_seeds.py), giving t_0..t_k.
The accepted run is d_1..d_a, the longest prefix with t_{j-1} == d_j, followed by t_a.

This is rejection sampling for proposers whose draft distribution q is one-hot at the proposed token
(n-gram lookup, and a draft model proposing greedily): accepting d with probability min(1, p/q) =
p(d) and, on rejection, drawing from normalize((p - q)+) = p without d, is the same as drawing t ~ p
and accepting when t == d (P = p(d)), else keeping t (distributed as p restricted to t != d). So the
output has exactly the non-speculative distribution, and a greedy row (t = argmax) reproduces
non-speculative greedy decoding token for token. A seeded row draws what a non-speculative step at
the same position draws, so a seeded request's output does not depend on how many drafts its steps
got (nor on the batch that decided it): it is its output without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.sample.position_seeds import position_generator
from tokenmill.sample.sampling_batch import SamplingBatch
from tokenmill.sample.sampling_params import SamplingParams


class DraftPositionMatcher:
    """Row j of a constrained request's verification: its grammar after the first j drafts.

    The request's matcher is advanced through the drafts only while filling this row's bitmask and
    rolled back at once, so the matcher itself never holds an unverified token. Drafts the grammar
    refuses stop the advance; rows after such a draft are never accepted (the refused draft cannot
    equal a token sampled under the mask), so their mask only needs to be some legal one.
    """

    def __init__(self, matcher: Any, drafts: Sequence[int]) -> None:
        self.matcher = matcher
        self.drafts = drafts
        self.backend = matcher.backend  # apply_grammar_masks finds the backend through any row

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        advanced = 0
        for token in self.drafts:
            if not self.matcher.accept_token(token):
                break
            advanced += 1
            if self.matcher.is_terminated():
                # Nothing may follow the end of the structure; this row's token will not be used.
                self.matcher.rollback(1)
                advanced -= 1
                break
        try:
            self.matcher.fill_bitmask(bitmask, row)
        finally:
            if advanced:
                self.matcher.rollback(advanced)


def verification_batch(
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    prompts: Sequence[list[int]],
    outputs: Sequence[list[int]],
    drafts: Sequence[Sequence[int]],
    matchers: Sequence[Any | None] | None,
) -> SamplingBatch:
    """The sampling rows of one step: per request, one row per draft plus one (just one without drafts).

    Row j of a request sees output + drafts[:j] as its history and, if the request is seeded, draws
    from the generator of output position len(output) + j. Row 0 passes the request's own output
    list, which the penalty history tracks incrementally across steps.
    """
    rows_params: list[SamplingParams] = []
    rows_gens: list[torch.Generator | None] = []
    rows_prompts: list[list[int]] = []
    rows_outputs: list[list[int]] = []
    rows_matchers: list[Any | None] | None = [] if matchers is not None else None
    for i, d in enumerate(drafts):
        for j in range(len(d) + 1):
            rows_params.append(params[i])
            seed = seeds[i]
            rows_gens.append(None if seed is None else position_generator(seed, len(outputs[i]) + j))
            rows_prompts.append(prompts[i])
            rows_outputs.append(outputs[i] if j == 0 else outputs[i] + list(d[:j]))
            if rows_matchers is not None:
                m = matchers[i]  # type: ignore[index]
                rows_matchers.append(m if m is None or j == 0 else DraftPositionMatcher(m, d[:j]))
    return SamplingBatch(rows_params, rows_gens, rows_prompts, rows_outputs, rows_matchers)


def accepted_run(sampled: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """sampled: the k + 1 tokens of one request's rows. Returns the drafts the target agreed with,
    then the target's own token at the first disagreement (or after the last draft)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled rows, got {len(sampled)}")
    run: list[int] = []
    for token, draft in zip(sampled, drafts):
        run.append(token)
        if token != draft:
            return run
    run.append(sampled[-1])
    return run
