"""What a proposer is to the engine, and how the engine picks one from its config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig, SpeculativeConfig
    from tokenmill.engine.request import Request


class Proposer(Protocol):
    """Guesses the next tokens of decoding requests; the target verifies them in the next step.

    The engine calls `propose` at the end of a step for the requests that will decode next, and
    `release` whenever a request stops holding KV (finished, aborted, preempted), so a proposer with
    state of its own (a draft model's KV pages) gives it back at the same moment the target does.
    """

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        """Up to max_tokens[i] guesses for what follows requests[i].all_token_ids (may be fewer, or none)."""
        ...

    def release(self, request_id: str) -> None: ...

    def check_idle(self) -> None:
        """Raises if anything is still held for a request while nothing runs (a leak)."""
        ...


def build_proposer(config: EngineConfig, target_vocab_size: int) -> Proposer | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from tokenmill.engine.spec.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from tokenmill.engine.spec.draft import build_draft_proposer

    return build_draft_proposer(config, target_vocab_size)


def propose_drafts(
    proposer: Proposer, spec: SpeculativeConfig, running: Sequence[Request], max_model_len: int, vocab_size: int
) -> None:
    """Fills `spec_token_ids` of every running request that decodes next, unless the batch is too
    large for speculation to pay (`disable_by_batch_size`)."""
    if not running or len(running) >= spec.disable_by_batch_size:
        return
    ready = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
    # A step may append at most k + 1 tokens: never plan past max_tokens or the context.
    ks = [
        min(spec.num_speculative_tokens, r.max_tokens - len(r.output_token_ids) - 1, max_model_len - r.num_tokens - 1)
        for r in ready
    ]
    wanted = [(r, k) for r, k in zip(ready, ks) if k > 0]
    if not wanted:
        return
    proposals = proposer.propose([r for r, _ in wanted], [k for _, k in wanted])
    for (r, k), tokens in zip(wanted, proposals):
        bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise AssertionError(f"request {r.request_id!r}: proposer returned token id {bad}")
        r.spec_token_ids = list(tokens[:k])
