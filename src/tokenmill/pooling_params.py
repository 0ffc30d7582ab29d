"""What an embedding request asks of the engine (vLLM's `PoolingParams`): the request kind that
computes its prompt once, keeps no KV and samples nothing, but returns one pooled hidden state.

It lives at the top of the package, beside `config.py`, because every layer names it: the API
process builds it (and must not import torch or the engine), the IPC messages carry it, the
engine schedules by it and the runner pools by its type.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.errors import InvalidRequest

# How hidden states of a prompt become one vector: the last token's (decoder models, the default),
# the mean over all tokens, or the first token's (BERT's [CLS]).
POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    # None: what the model's files declare (model/pooling.py), else "last".
    pooling_type: str | None = None
    normalize: bool = True  # L2-normalise the pooled vector (what sentence-transformers' Normalize does)

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequest(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}", "pooling_type")
        if not isinstance(self.normalize, bool):
            raise InvalidRequest(f"normalize must be a bool, got {self.normalize!r}", "normalize")
