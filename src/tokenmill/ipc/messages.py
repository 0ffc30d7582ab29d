"""Every message that crosses a process boundary, as msgspec structs (msgpack on the wire, never pickle).

Three PULL sockets, one per receiving process; each decodes a tagged union of what may arrive there:

    main -> scheduler      AddRequest, AbortRequest                 (ToScheduler)
    detokenizer -> sched.  FinishRequest (a stop string matched)    (ToScheduler)
    scheduler -> detok.    DetokenizeRequest, TokenBatch            (ToDetokenizer)
    detokenizer -> main    TextBatch                                (ToMain)
    scheduler -> main      SchedulerReady, RequestFailed, SchedulerStats, ProcessFailed,
                           EmbeddingBatch (embedding requests never reach the detokenizer)  (ToMain)
    detokenizer -> main    DetokenizerReady, ProcessFailed          (ToMain)

A detokenizer learns about a request from the scheduler (DetokenizeRequest), on the same channel as its
token outputs, so it can never see tokens of a request it does not know yet.
"""

from __future__ import annotations

import msgspec

from tokenmill.pooling_params import PoolingParams
from tokenmill.sample.sampling_params import SamplingParams


class Logprob(msgspec.Struct, array_like=True):
    """One generated token's log-probability (raw model distribution), rank and top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


# ---- main -> scheduler -----------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # a dataclass: msgspec rebuilds it and re-runs its validation
    cache_salt: str | None = None
    # Set: an embedding request (engine/pooling.py); `params` is then ignored.
    pooling: PoolingParams | None = None
    # The server's own /health probe: served as any request, left out of the request token counters.
    internal: bool = False


class AbortRequest(msgspec.Struct, tag=True):
    """The client went away (or the server ends the request): free its KV. Unknown ids are ignored."""

    request_id: str


# ---- detokenizer -> scheduler -----------------------------------------------------------------
class FinishRequest(msgspec.Struct, tag=True):
    """A stop string matched: stop generating and free the KV (the text side already ended it)."""

    request_id: str
    stop_reason: str | None


# ---- scheduler -> detokenizer -----------------------------------------------------------------
class DetokenizeRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class TokenOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None
    logprobs: list[Logprob] | None = None
    queue_time: float | None = None  # seconds from admission to first scheduled; first output only
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # params.prompt_logprobs, first output only: entry i scores prompt token i (entry 0 is None)
    prompt_logprobs: list[Logprob | None] | None = None
    # the finished output: the engine's stage timeline (engine/timeline.py summary), in seconds
    timeline: dict | None = None


class TokenBatch(msgspec.Struct, tag=True):
    """What one engine step produced, for every request that produced something."""

    outputs: list[TokenOutput]


# ---- detokenizer -> main ----------------------------------------------------------------------
class TextOutput(msgspec.Struct, array_like=True):
    """New text and tokens of one request since its last TextOutput (output mode DELTA)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_output_tokens: int  # tokens counted so far: usage, never past a stop string
    logprobs: list[Logprob] | None = None  # one per token in token_ids
    queue_time: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprob | None] | None = None
    timeline: dict | None = None  # as TokenOutput's; may come after the text finished (a stop string)
    # The last text only: the detokenizer's durations on its own clock, {"held_s", "busy_s"}
    # (frontend/request_timelines.py); durations, because another process's timestamps mean nothing here.
    detokenizer: dict[str, float] | None = None


class TextBatch(msgspec.Struct, tag=True):
    outputs: list[TextOutput]


# ---- scheduler -> main: embeddings ------------------------------------------------------------
class EmbeddingOutput(msgspec.Struct, array_like=True):
    request_id: str
    embedding: bytes  # float32, little-endian: 4 bytes a dimension, half of msgpack's float64 list


class EmbeddingBatch(msgspec.Struct, tag=True):
    """The embedding requests one engine step finished (each ends in one output)."""

    outputs: list[EmbeddingOutput]


# ---- control messages to main -----------------------------------------------------------------
class SchedulerReady(msgspec.Struct, tag=True):
    """The start-up handshake: the limits the API server validates against before queueing."""

    model_name: str
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int
    supports_cache_salt: bool
    supports_prompt_logprobs: bool  # the engine honours SamplingParams.prompt_logprobs
    kv_capacity_note: str = ""  # why kv_capacity_tokens is less than the pool (hybrid KV groups), for errors


class DetokenizerReady(msgspec.Struct, tag=True):
    pass


class ProcessFailed(msgspec.Struct, tag=True):
    """A child could not start (or hit a fatal error); the server logs it and turns unhealthy."""

    process: str
    error: str


class RequestFailed(msgspec.Struct, tag=True):
    """The scheduler ended a request outside the output stream (rejected at admission, engine fault)."""

    request_id: str
    message: str
    status: int = 400
    param: str | None = None


class SchedulerStats(msgspec.Struct, tag=True):
    num_requests_running: int
    num_requests_waiting: int
    kv_pages_total: int
    kv_pages_in_use: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_hit_tokens_total: int
    num_preemptions: int
    # Speculative decoding (zero when off): verified rows with drafts, draft tokens verified, accepted,
    # and the tokens those rows emitted.
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_emitted_tokens_total: int = 0
    # Tokens (prompt + output so far) of every unfinished request, waiting or running: the load the
    # data-parallel controller's least_tokens policy compares (SGLang's total_tokens).
    num_tokens: int = 0
    # The live dashboard (engine/step_stats.py, entrypoints/openai/dashboard.py). time_s is the
    # scheduler's monotonic clock when sent: rates are deltas of two messages on that one clock.
    time_s: float = 0.0
    num_requests_preempted: int = 0
    kv_pages_free: int = 0
    kv_pages_cached: int = 0
    prefix_cache_queries_tokens_total: int = 0
    step_token_budget: int = 0
    step_count_total: int = 0
    step_time_total_s: float = 0.0
    step_prefill_tokens_total: int = 0
    step_decode_rows_total: int = 0
    last_step_prefill_tokens: int = 0
    last_step_decode_rows: int = 0
    last_step_draft_tokens: int = 0
    last_step_num_tokens: int = 0
    last_step_time_s: float = 0.0
    # the radix tree's longest shared prefixes (RadixCache.shared_prefixes, as dicts), refreshed slower
    prefix_tree_top: list[dict] = []
    kv_cache_dtype: str = ""  # how K/V are stored: fp32, bf16 or int8
    kv_cache_bytes_per_token: int = 0
    # Hybrid KV cache only (kvcache/kv_groups.py), one dict per KV group: group, layers, window (0:
    # full attention), pages_in_use, pages_cached (engine/engine_stats.kv_group_stats); [] otherwise.
    kv_groups: list[dict] = []


ToScheduler = AddRequest | AbortRequest | FinishRequest
ToDetokenizer = DetokenizeRequest | TokenBatch
ToMain = TextBatch | EmbeddingBatch | SchedulerReady | DetokenizerReady | ProcessFailed | RequestFailed | SchedulerStats
