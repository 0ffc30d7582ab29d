"""Counters of speculative decoding: what was proposed, what the target accepted, what it emitted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verified rows that carried at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # draft tokens the target agreed with
    num_emitted_tokens: int = 0  # tokens appended by those rows: accepted + the target's own

    def record(self, num_draft_tokens: int, num_accepted: int, num_emitted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted

    def as_dict(self) -> dict[str, int | float]:
        return {
            "spec_decode_num_drafts_total": self.num_drafts,
            "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
            "spec_decode_num_emitted_tokens_total": self.num_emitted_tokens,
            # Share of draft tokens accepted, and tokens a verified row yields (accepted + 1, as vLLM
            # reports its mean acceptance length).
            "spec_decode_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
        }
