"""The checks a prompt must pass against the engine's limits before anything is queued.

The scheduler reports its limits once, in its handshake (`SchedulerReady`: vocabulary, context length,
KV capacity); the API process then answers a request that cannot run with a 400 naming the parameter,
instead of sending it on and waiting for the engine to refuse it (`EngineCore.add_request` applies the
same numbers). Pure functions of (ids, params, limits): the tokenizer manager, the fake servers of the
tests and any later router call them alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.errors import InvalidRequest
from tokenmill.frontend.request_error import RequestError
from tokenmill.ipc.messages import SchedulerReady
from tokenmill.sample.sampling_params import SamplingParams


def check_token_ids(ids: Sequence[int], limits: SchedulerReady, param: str, what: str = "prompt token id") -> None:
    """Every id inside the vocabulary (an id past it would index past the embedding table)."""
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{what} {bad} is outside the vocabulary (size {limits.vocab_size})", param)


def check_prompt(ids: Sequence[int], params: SamplingParams, limits: SchedulerReady, param: str) -> None:
    """A generation request: a non-empty prompt of known ids that leaves room in the context for
    max_tokens, and fits the KV pool whole (a request larger than the pool could never finish)."""
    if not ids:
        raise InvalidRequest("the prompt is empty", param=param)
    check_token_ids(ids, limits, param)
    params.check_token_ids(limits.vocab_size)
    room = limits.max_model_len - len(ids)
    if room < 1:
        raise RequestError(
            f"this model's context length is {limits.max_model_len} tokens, but the prompt has "
            f"{len(ids)} tokens, which leaves no room for output",
            400, param, "context_length_exceeded",
        )
    # Left out, max_tokens is what the context leaves, and never more than the KV pool can hold (a
    # pool smaller than the context would otherwise refuse every request that leaves it out).
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = min(room, limits.kv_capacity_tokens - len(ids))
        if max_tokens < 1:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens, which fills the KV cache ({limits.kv_capacity_tokens} "
                f"tokens a request) and leaves no room for output{_note(limits)}", param=param,
            )
    if max_tokens > room:
        raise RequestError(
            f"this model's context length is {limits.max_model_len} tokens; the prompt ({len(ids)} "
            f"tokens) + max_tokens ({max_tokens}) exceeds it",
            400, "max_tokens", "context_length_exceeded",
        )
    if len(ids) + max_tokens > limits.kv_capacity_tokens:
        raise InvalidRequest(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the KV cache "
            f"({limits.kv_capacity_tokens} tokens a request){_note(limits)}", param="max_tokens",
        )


def _note(limits: SchedulerReady) -> str:
    """Why a request has less room than the pool has slots (hybrid KV groups), after "; ", or "" (as
    engine/admission.py words it)."""
    return f"; {limits.kv_capacity_note}" if limits.kv_capacity_note else ""


def check_embedding_input(ids: Sequence[int], limits: SchedulerReady, param: str) -> None:
    """An embedding input: non-empty, known ids, within the context (no output, so no room needed)."""
    if not ids:
        raise InvalidRequest("an input is empty", param=param)
    check_token_ids(ids, limits, param, what="token id")
    if len(ids) > limits.max_model_len:
        raise RequestError(f"this model's context length is {limits.max_model_len} tokens, but an input "
                           f"has {len(ids)} tokens", 400, param, "context_length_exceeded")
