"""The detokenizer's state table is bounded and never loses a live request (issue 12): admission
keeps live sequences under the bound (preempted ones included), the relation is checked at start-up,
and a full table refuses a newcomer with a 503 instead of evicting anyone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill.frontend.detokenizer_process import Detokenizer
from tokenmill.frontend.live_bound import HEALTH_PROBES, check_live, install_live_bound
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.frontend.tokenizer_manager import RequestError
from tokenmill.ipc.messages import AbortRequest, DetokenizeRequest, RequestFailed, TokenBatch, TokenOutput
from tokenmill.sample.sampling_params import OutputKind, SamplingParams


def fake_manager(queued_bound: int, states: list[bool]) -> SimpleNamespace:
    rejected: list[str] = []
    unhealthy: list[str] = []
    return SimpleNamespace(
        queued_bound=lambda limits: queued_bound, limits=object(), live_bound=None, RETRY_AFTER_S=1,
        _states={f"r{i}": SimpleNamespace(finished=f) for i, f in enumerate(states)},
        metrics=SimpleNamespace(observe_rejected=rejected.append), rejected=rejected,
        mark_unhealthy=unhealthy.append, unhealthy=unhealthy,
    )


def test_start_up_refuses_bounds_that_could_overfill_the_table() -> None:
    manager = fake_manager(100, [])
    assert not install_live_bound(manager, 28, detokenizer_max_states=129)
    assert "exceed the detokenizer's 129 request states" in manager.unhealthy[0]
    assert manager.live_bound is None
    assert install_live_bound(manager, 28, detokenizer_max_states=128 + HEALTH_PROBES)
    assert manager.live_bound == 128


def test_admission_counts_every_live_sequence() -> None:
    # 2 queued + 2 running + 1 preempted with output: 5 live, though the queue alone looks half empty.
    manager = fake_manager(4, [False] * 5 + [True] * 3)  # 3 finished ones do not count
    manager.live_bound = 4 + 2
    check_live(manager, [object()], internal=False)  # the 6th fits
    with pytest.raises(RequestError) as full:
        check_live(manager, [object(), object()], internal=False)
    assert (full.value.status, full.value.code, full.value.headers) == (503, "server_overloaded", {"Retry-After": "1"})
    assert manager.rejected == ["too_many_live"]
    check_live(manager, [object()] * 3, internal=True)  # health probes are never refused


def test_a_full_table_refuses_the_newcomer_and_keeps_the_rest(smol_tokenizer: Tokenizer) -> None:
    detok = Detokenizer(smol_tokenizer, max_states=2)
    params = SamplingParams(output_kind=OutputKind.DELTA)
    ids = smol_tokenizer.encode(" one two three", add_special_tokens=False)
    for rid in ("a", "b"):
        assert detok.handle(DetokenizeRequest(rid, [1], params)) == ([], [])
    texts, orders = detok.handle(DetokenizeRequest("c", [1], params))
    assert (texts, orders) == ([], [AbortRequest("c")])
    assert detok.refused == [RequestFailed("c", detok.refused[0].message, 503)]
    assert "overloaded" in detok.refused[0].message and set(detok.seqs) == {"a", "b"}
    outs, _ = detok.handle(TokenBatch([TokenOutput(rid, ids, True, "length", None) for rid in ("a", "b")]))
    assert {o.request_id: o.text for o in outs} == {"a": " one two three", "b": " one two three"}
    assert detok.seqs == {}
    assert detok.handle(DetokenizeRequest("d", [1], params)) == ([], [])  # room again
