"""Tensor-parallel ranks drop their idle memory (the large steps' weight copies) when rank 0's engine
has no request left: rank 0's runner broadcasts IDLE, the ranks' loop releases and waits on; a rank
that is gone costs a warning, not the engine."""

from __future__ import annotations

import logging

from tokenmill.model.runner import SeqChunk
from tokenmill.parallel.runner import IDLE, STOP, TensorParallelRunner, _encode, serve_steps


class Group:
    """A process group stand-in: records what rank 0 broadcasts, hands a rank > 0 queued payloads."""

    def __init__(self, payloads: list[bytes] = (), fail: bool = False) -> None:
        self.payloads, self.sent, self.fail = list(payloads), [], fail

    def broadcast_bytes(self, data: bytes) -> bytes:
        if self.fail and data != STOP:
            raise RuntimeError("rank 1 is gone")
        self.sent.append(data)
        return self.payloads.pop(0) if self.payloads else data

    def close(self) -> None:
        pass


class Runner:
    def __init__(self) -> None:
        self.executed, self.releases = [], 0
        self.model = self.kv_caches = self.kv_layout = self.kv_format = None
        self.page_size, self.num_pages, self.kv_bytes_per_token = 16, 4, 0

    def execute(self, chunks):
        self.executed.append(chunks)

    def release_idle_memory(self) -> None:
        self.releases += 1


CHUNKS = [SeqChunk([1, 2, 3], 0, [0], sample=True)]


def test_a_rank_releases_on_idle_and_goes_on_serving_steps():
    runner = Runner()
    group = Group([_encode(CHUNKS), IDLE, IDLE, _encode(CHUNKS), STOP])
    assert serve_steps(runner, group) == 2  # idle messages are not steps
    assert runner.releases == 2 and runner.executed == [CHUNKS, CHUNKS]


def test_rank_0_releases_its_own_and_tells_the_others():
    inner, group = Runner(), Group()
    tp = TensorParallelRunner(inner, group)
    tp.release_idle_memory()
    assert inner.releases == 1 and group.sent == [IDLE]
    tp.shutdown()
    assert group.sent == [IDLE, STOP]


def test_a_rank_gone_costs_a_warning_not_the_engine(caplog):
    inner, group = Runner(), Group(fail=True)
    tp = TensorParallelRunner(inner, group)
    with caplog.at_level(logging.WARNING):
        tp.release_idle_memory()
    assert inner.releases == 1 and "idle message not delivered: rank 1 is gone" in caplog.text
    tp.shutdown()


def test_no_step_payload_reads_as_idle_or_stop():
    # a step's payload is a msgpack list (its first byte 0x90-0x9f or 0xdc-0xdd); IDLE starts with 'i'
    for chunks in ([], CHUNKS, CHUNKS * 20):
        payload = _encode(chunks)
        assert payload not in (IDLE, STOP) and payload[0] != IDLE[0]
