"""Embedding requests inside the engine: prefill-only requests that share the step's batch.

An embedding request is an ordinary `Request` with `pooling` set. The scheduler gives it prompt
chunks under the same token budget as everything else; it never samples (max_tokens 0, no logits
row), never matches or feeds the prefix cache (its K/V is dropped the step it finishes: its pages
go straight back to the pool), and ends, "stop", in the step that computes its last prompt token,
with the pooled final hidden state as its output. The runner reduces each chunk's rows
(model/pooling.py); `PooledState` here combines the chunks of one prompt.

Why no prefix cache: mean and cls pooling need the hidden state of every prompt position, which a
cache hit does not compute; and embedding inputs (documents) are rarely a prefix of a later chat,
so publishing their pages would only evict pages a generation request could have reused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.engine.request import Request
from tokenmill.errors import InvalidRequest
from tokenmill.model.runner import SeqChunk
from tokenmill.pooling_params import PoolingParams
from tokenmill.sample.sampling_params import SamplingParams


class PooledState:
    """The pooled vector of one request's prompt, built chunk by chunk."""

    def __init__(self, pooling_type: str, normalize: bool) -> None:
        self.pooling_type = pooling_type
        self.normalize = normalize
        self._acc: torch.Tensor | None = None

    def reset(self) -> None:
        """A preempted request recomputes its prompt from position 0: start again."""
        self._acc = None

    def add(self, part: torch.Tensor, start: int) -> None:
        """`part`: one chunk's reduction (runner); `start`: the chunk's first position."""
        if self.pooling_type == "last" or self._acc is None:
            if self.pooling_type != "cls" or start == 0:
                self._acc = part
        elif self.pooling_type == "mean":
            self._acc = self._acc + part

    def result(self, num_tokens: int) -> torch.Tensor:
        if self._acc is None:
            raise AssertionError("a pooling request finished without a computed chunk")
        vector = self._acc / num_tokens if self.pooling_type == "mean" else self._acc
        return F.normalize(vector, dim=0) if self.normalize else vector


# An embedding request's SamplingParams: a placeholder, it never samples and wants no output token.
_NO_SAMPLING = SamplingParams(max_tokens=1)


def pooling_request(request_id: str, prompt_token_ids: list[int], params: PoolingParams, model_pooling: str,
                    max_model_len: int, kv_capacity: int) -> Request:
    """The engine request of an embedding: the input must fit the context and the KV pool whole
    (no room for output needed); `model_pooling` is the type the model's files declare."""
    n = len(prompt_token_ids)
    if n > max_model_len:
        raise InvalidRequest(f"the input has {n} tokens; the context length is {max_model_len}", "input")
    if n > kv_capacity:
        raise InvalidRequest(f"the input has {n} tokens; the KV cache holds {kv_capacity}", "input")
    request = Request(request_id, list(prompt_token_ids), _NO_SAMPLING, 0)
    request.pooled = PooledState(params.pooling_type or model_pooling, params.normalize)
    return request


def add_pooled_parts(requests: list[Request], chunks: list[SeqChunk], pooled: list[torch.Tensor]) -> list[Request]:
    """Adds each embedding chunk's part (the runner's, in chunk order) to its request; returns the
    requests whose prompt is now complete (their `num_computed_tokens` already counts this step)."""
    parts = iter(pooled)
    done = []
    for r, chunk in zip(requests, chunks):
        if r.pooled is not None:
            r.pooled.add(next(parts), chunk.start)
            if r.num_computed_tokens == r.num_tokens:
                done.append(r)
    return done
