"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import InvalidRequest, is_int

# Keeps the per-step top-N logprob gather cheap; vLLM caps it at 20 by default too.
MAX_LOGPROBS = 20


class OutputKind(enum.Enum):
    DELTA = "delta"  # only what is new since the last output
    CUMULATIVE = "cumulative"  # everything so far, every time
    FINAL_ONLY = "final_only"  # one output when the request finishes


# Each of n samples is an engine request: n = 10**9 once queued requests for minutes without a word.
# The HTTP API allows OpenAI's 128 (entrypoints/openai/params.py); offline, more than this is a mistake.
MAX_SAMPLES = 1024


@dataclass(frozen=True)
class StructuredOutputParams:
    """Exactly one constraint; the engine compiles it to a grammar (sample/grammar.py).

    `param` is the request field it came from ("response_format", "guided_json", ...), so an error found
    while compiling names what the client actually sent.
    """

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})
    regex: str | None = None
    grammar: str | None = None  # EBNF (GBNF-style, as xgrammar and vLLM's guided_grammar take it)
    choice: list[str] | None = None
    param: str = "structured_output"

    def __post_init__(self) -> None:
        def bad(why: str) -> InvalidRequest:
            return InvalidRequest(f"{self.param} {why}", param=self.param)

        given = [n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None]
        if not isinstance(self.json_object, bool):
            raise bad(f"json_object must be a bool, got {self.json_object!r}")
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise bad(f"needs exactly one of json_schema, json_object, regex, grammar, choice; got {given or 'none'}")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            raise bad(f"json_schema must be an object or a string, got {type(self.json_schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(f"{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise bad("choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None)

    def cache_key(self) -> tuple[str, str]:
        """Hashable and canonical (a schema dict with its keys in another order is the same schema)."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        value = getattr(self, kind)
        if isinstance(value, str):
            return kind, value
        return kind, json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length, or what the KV pool holds if less
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1 (or 0) disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    bad_words_token_ids: list[int] | None = None  # token ids that are never sampled
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None  # top-N per generated token, plus the sampled token's own
    prompt_logprobs: int | None = None
    output_kind: OutputKind = OutputKind.CUMULATIVE
    stream_interval: int = 1
    # Constrained decoding (JSON schema, regex, EBNF, choice); None: free text.
    structured_output: StructuredOutputParams | None = None
    # Scheduling priority (vLLM's `priority`): lower runs sooner. Only an engine started with
    # scheduling_policy="priority" takes a value other than 0.
    priority: int = 0
    # Filled by validation: stop as a list, for the code that checks it.
    stop_strings: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{param} {why}", param=param)

        if not is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise bad("n", f"must be an integer from 1 to {MAX_SAMPLES}, got {self.n!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", f"must be -1 or 0 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value!r}")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not is_int(token_id) or token_id < 0:
                    raise bad("logit_bias", f"keys must be token ids >= 0, got {token_id!r}")
                if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {bias!r} for token {token_id}")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        # torch.Generator.manual_seed takes a 64-bit value; outside it, it fails with a bare overflow.
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", f"must fit in 64 bits, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        for name in ("stop_token_ids", "bad_words_token_ids"):
            ids = getattr(self, name)
            if ids is not None and (not isinstance(ids, list) or not all(is_int(t) and t >= 0 for t in ids)):
                raise bad(name, "must be a list of token ids >= 0")
        if not is_int(self.stream_interval) or self.stream_interval < 1:
            raise bad("stream_interval", f"must be an integer >= 1, got {self.stream_interval!r}")
        if not is_int(self.priority) or not -(2**63) <= self.priority < 2**63:
            raise bad("priority", f"must be a 64-bit integer, got {self.priority!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputParams):
            raise bad("structured_output", "must be a StructuredOutputParams")

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids can only be checked once the model (its vocabulary) is known."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("stop_token_ids", self.stop_token_ids or []),
            ("bad_words_token_ids", self.bad_words_token_ids or []),
        ):
            for token_id in ids:
                if token_id >= vocab_size:
                    raise InvalidRequest(
                        f"{name} names token id {token_id}, outside the vocabulary (size {vocab_size})",
                        param=name,
                    )


def _is_number(value: object) -> bool:
    # NaN and inf slip through every range check below (NaN compares False), so refuse them here.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


