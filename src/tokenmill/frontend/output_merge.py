"""Outputs that piled up for a request while its consumer was busy, merged into one per sequence.

A slow consumer (a client reading slowly) must not make the engine wait, and must not receive a
backlog of tiny chunks either: TokenizerManager.generate hands on whatever is queued, merged here.
"""

from __future__ import annotations

from typing import TypeVar

from tokenmill.ipc.messages import TextOutput

E = TypeVar("E", bound=Exception)


def merge_pending(
    pending: list[tuple[int, TextOutput] | E],
) -> tuple[list[tuple[int, TextOutput]], E | None]:
    """Queued DELTA outputs merged per sequence (in order of first appearance), and the first error
    queued among them, if any (what came before it is still delivered)."""
    merged: dict[int, TextOutput] = {}
    for item in pending:
        if not isinstance(item, tuple):  # an error queued for the request
            return list(merged.items()), item
        index, out = item
        prev = merged.get(index)
        merged[index] = out if prev is None else _merge(prev, out)
    return list(merged.items()), None


def _merge(a: TextOutput, b: TextOutput) -> TextOutput:
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return TextOutput(
        request_id=b.request_id,
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        finished=b.finished,
        finish_reason=b.finish_reason,
        stop_reason=b.stop_reason,
        num_output_tokens=b.num_output_tokens,
        logprobs=logprobs,
        queue_time=a.queue_time if a.queue_time is not None else b.queue_time,
        num_cached_tokens=b.num_cached_tokens,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        timeline=b.timeline if b.timeline is not None else a.timeline,
    )
