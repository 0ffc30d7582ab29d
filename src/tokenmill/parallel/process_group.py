"""The tensor-parallel process group: who this rank is, and the three collectives the model needs.

torch.distributed does the transport (gloo on CPU, NCCL where tensors live on a GPU). Two groups:
`compute` for the per-layer all-reduces and the logits all-gather, which complete within a step, and
`steps` for rank 0's broadcast of each step's batch, on which the other ranks wait while the server
is idle, so it gets a timeout of its own that an idle server never reaches.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# All ranks must have joined within this (a rank that failed to start fails the others' start-up).
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)
# Within a step a rank waits for the others at most this long before the collective fails.
COMPUTE_TIMEOUT = datetime.timedelta(minutes=10)
# Ranks > 0 wait for the next step for as long as the server idles.
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Endpoint:
    """Where rank 0 listens for the others (torchrun's MASTER_ADDR / MASTER_PORT)."""

    addr: str
    port: int


class TensorParallelGroup:
    def __init__(self, rank: int, world_size: int, endpoint: Endpoint) -> None:
        self.rank = rank
        self.world_size = world_size
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{endpoint.addr}:{endpoint.port}", rank=rank,
                                world_size=world_size, timeout=RENDEZVOUS_TIMEOUT)
        ranks = list(range(world_size))
        self._compute = dist.new_group(ranks, timeout=COMPUTE_TIMEOUT, backend=backend)
        self._steps = dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend="gloo")
        logger.info("tensor-parallel rank %d of %d joined (%s, rank 0 at %s:%d)", rank, world_size, backend,
                    endpoint.addr, endpoint.port)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` over the ranks, in place."""
        dist.all_reduce(t, group=self._compute)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t`, side by side along the last dimension, in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self._compute)
        return torch.cat(parts, dim=-1)

    def broadcast_bytes(self, payload: bytes) -> bytes:
        """Rank 0 sends `payload` (one step's batch, encoded); every rank returns it."""
        size = torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.long)
        dist.broadcast(size, src=0, group=self._steps)
        if self.rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        if data.numel():
            dist.broadcast(data, src=0, group=self._steps)
        return payload if self.rank == 0 else data.numpy().tobytes()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
