"""What a request must satisfy before it is queued, as plain checks that raise InvalidRequest naming
the field: the prompt itself (every request), and for sampling requests the room their output needs
(context length, KV pool) and the settings this engine can honour. EngineCore.add_request calls them."""

from __future__ import annotations

from collections.abc import Container

from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import SamplingParams


def check_prompt(request_id: str, prompt_token_ids: list[int], cache_salt: str | None, known_ids: Container[str],
                 vocab_size: int) -> None:
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidRequest(f"cache_salt must be a string, got {type(cache_salt).__name__}", param="cache_salt")
    if request_id in known_ids:
        raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary (size {vocab_size})", "prompt")


def resolve_max_tokens(params: SamplingParams, n_prompt: int, vocab_size: int, max_model_len: int, capacity: int,
                       scheduling_policy: str, capacity_note: str = "") -> int:
    """The request's max_tokens (params', or what the context leaves), after checking that the prompt
    and that many tokens fit the context and the KV pool (`capacity` tokens a request; `capacity_note`:
    why that is less than the pool's slots, Scheduler.capacity_note) and that this engine can honour
    its settings."""
    params.check_token_ids(vocab_size)
    if params.priority != 0 and scheduling_policy != "priority":
        raise InvalidRequest(
            f"priority {params.priority} needs the priority scheduling policy (scheduling_policy='priority', "
            "`serve --scheduling-policy priority`); this engine serves first come first served",
            param="priority",
        )
    room = max_model_len - n_prompt
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {n_prompt} tokens; the context length is {max_model_len}, "
            "which leaves no room for output",
            param="prompt",
        )
    # Left out: what the context leaves, and never more than the KV pool can hold (as the API checks).
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = min(room, capacity - n_prompt)
        if max_tokens < 1:
            raise InvalidRequest(
                f"the prompt has {n_prompt} tokens, which fills the KV cache ({capacity} tokens a request) and "
                f"leaves no room for output{'; ' + capacity_note if capacity_note else ''}", param="prompt",
            )
    if max_tokens > room:
        raise InvalidRequest(
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context length "
            f"{max_model_len}",
            param="max_tokens",
        )
    if n_prompt + max_tokens > capacity:
        raise InvalidRequest(
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the KV cache "
            f"({capacity} tokens a request); {capacity_note or 'raise kv_cache_tokens or lower max_tokens'}",
            param="max_tokens",
        )
    return max_tokens
