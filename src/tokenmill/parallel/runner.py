"""Runs one engine step on every tensor-parallel rank at once.

Rank 0 owns the scheduler: its runner broadcasts each step's chunks (msgpack) and then runs the model
like any runner; every other rank waits for the chunks, prepares the same flat batch (the page ids
are the same on every rank: each rank's pool has the same pages, holding only its own KV heads) and
runs its shard, meeting rank 0 at each layer's all-reduce. Logits come back on every rank; only rank
0 samples.
"""

from __future__ import annotations

import logging
import struct
import subprocess
import weakref

import msgspec
import torch

from tokenmill.model.runner import ModelRunner, SeqChunk
from tokenmill.parallel.process_group import TensorParallelGroup

logger = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode
_decode_chunks = msgspec.msgpack.Decoder(list[SeqChunk]).decode
STOP = b""  # an empty step: the ranks leave their loop
IDLE = b"idle"  # rank 0's engine has no request left: the ranks drop their idle memory (not msgpack of a list)
COPY = b"copy"  # followed by two int64 page ids: each rank copies page src to dst in its own pool


class TensorParallelRunner:
    """Rank 0's runner: the engine calls `execute` as on a ModelRunner."""

    def __init__(self, inner: ModelRunner, group: TensorParallelGroup,
                 workers: list[subprocess.Popen] | None = None) -> None:
        self.inner = inner
        self.group = group
        self.workers = workers or []  # ranks this process started (this node's), stopped with it
        self.model = inner.model
        self.page_size, self.num_pages, self.kv_caches = inner.page_size, inner.num_pages, inner.kv_caches
        self.kv_layout = inner.kv_layout
        self.kv_format, self.kv_bytes_per_token = inner.kv_format, inner.kv_bytes_per_token
        # A script that ends without shutdown() (no `with LLM(...)`) must still stop the ranks before
        # the interpreter's exit closes the group's sockets under them: each would otherwise log that
        # the group broke ("Connection closed by peer") on a normal exit. finalize runs at exit, or
        # when the runner is collected, and holds the group and the workers, never the runner.
        self._stop = weakref.finalize(self, _stop_ranks, group, self.workers)

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        self.group.broadcast_bytes(_encode(chunks))
        return self.inner.execute(chunks)

    def execute_pooled(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # The other ranks run `execute` on the same chunks: the same forward and the same collectives.
        self.group.broadcast_bytes(_encode(chunks))
        return self.inner.execute_pooled(chunks)

    def copy_page(self, src: int, dst: int) -> None:
        """Copies a page in every rank's pool (each holds its own KV heads of it)."""
        self.group.broadcast_bytes(COPY + struct.pack("<qq", src, dst))
        self.inner.copy_page(src, dst)

    def release_idle_memory(self) -> None:
        """Drops this rank's idle memory and tells the other ranks to drop theirs (their large steps'
        weight copies, as this rank's): without it they held them for the server's life."""
        self.inner.release_idle_memory()
        try:
            self.group.broadcast_bytes(IDLE)
        except RuntimeError as exc:  # a rank gone: the next step says so; housekeeping must not
            logger.warning("tensor-parallel idle message not delivered: %s", exc)

    def shutdown(self) -> None:
        """Tells the other ranks to stop, and waits for the ones this process started (once)."""
        self._stop()


def _stop_ranks(group: TensorParallelGroup, workers: list[subprocess.Popen]) -> None:
    try:
        group.broadcast_bytes(STOP)
    except RuntimeError as exc:  # a rank already gone: nothing left to tell it
        logger.warning("tensor-parallel stop not delivered: %s", exc)
    for proc in workers:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    group.close()


def serve_steps(runner: ModelRunner, group: TensorParallelGroup) -> int:
    """A rank > 0's life: run each step rank 0 broadcasts until it says stop. Returns the steps run."""
    steps = 0
    while True:
        payload = group.broadcast_bytes(b"")
        if payload == STOP:
            return steps
        if payload == IDLE:
            runner.release_idle_memory()
            continue
        if payload.startswith(COPY):
            runner.copy_page(*struct.unpack("<qq", payload[len(COPY):]))
            continue
        runner.execute(_decode_chunks(payload))
        steps += 1
