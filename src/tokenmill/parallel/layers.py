"""Layers whose result is combined across tensor-parallel ranks. Each wraps the rank's ordinary layer
(dense or quantized, whatever model/layers/ chose for its slice) and adds one collective, so the
model's own code calls them exactly as it calls an unsharded layer."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.parallel.process_group import TensorParallelGroup


class AllReduceLinear:
    """A row-parallel linear (o_proj, down): this rank's slice of the inputs gives a partial sum of
    every output; one all-reduce makes it the whole output on every rank."""

    def __init__(self, inner: Any, group: TensorParallelGroup) -> None:
        self.inner = inner
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x).float())

    def describe(self) -> str:
        return f"{self.inner.describe()}, row-parallel over {self.group.world_size} ranks (all-reduce)"


class VocabParallelEmbedding:
    """This rank holds vocabulary rows [start, end): it looks up the tokens in its range, leaves the
    others zero, and the all-reduce fills in each token's row from the rank that holds it."""

    def __init__(self, inner: Any, start: int, end: int, group: TensorParallelGroup) -> None:
        self.inner = inner
        self.start, self.end = start, end
        self.group = group

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        rows = self.inner(torch.where(mine, ids - self.start, torch.zeros_like(ids))).float()
        rows = rows * mine.unsqueeze(-1)
        return self.group.all_reduce(rows)


class VocabParallelLMHead:
    """This rank's logits for its vocabulary rows; an all-gather puts every rank's side by side.
    Shares are equal but the last may be shorter: padded with -inf, and the padding cut off."""

    def __init__(self, inner: Any, share: int, vocab_size: int, group: TensorParallelGroup) -> None:
        self.inner = inner
        self.share = share
        self.vocab_size = vocab_size
        self.group = group

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden).float()
        if local.shape[-1] < self.share:
            pad = local.new_full((*local.shape[:-1], self.share - local.shape[-1]), float("-inf"))
            local = torch.cat([local, pad], dim=-1)
        return self.group.all_gather_last_dim(local)[..., : self.vocab_size]

    def describe(self) -> str:
        return f"{self.inner.describe()}, vocabulary-parallel over {self.group.world_size} ranks (all-gather)"
