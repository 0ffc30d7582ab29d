"""A slow consumer gets one merged output per sequence, never a backlog of tiny chunks."""

from __future__ import annotations

from tokenmill.frontend.output_merge import merge_pending
from tokenmill.frontend.tokenizer_manager import RequestError
from tokenmill.ipc.messages import TextOutput


def out(text: str, ids: list[int], n: int, finished: bool = False) -> TextOutput:
    return TextOutput("r-0", text, ids, finished, "length" if finished else None, None, n)


def test_pending_deltas_merge_per_sequence_in_order():
    pending = [(0, out("Hel", [1], 1)), (1, out("A", [7], 1)), (0, out("lo", [2], 2)), (0, out("!", [3], 3, True))]
    merged, error = merge_pending(pending)
    assert error is None
    assert [i for i, _ in merged] == [0, 1]
    first = merged[0][1]
    assert (first.text, first.token_ids, first.num_output_tokens, first.finished) == ("Hello!", [1, 2, 3], 3, True)
    assert merged[1][1].text == "A" and not merged[1][1].finished


def test_outputs_before_an_error_are_still_delivered():
    error = RequestError("engine died", 503)
    merged, got = merge_pending([(0, out("a", [1], 1)), error, (0, out("b", [2], 2))])
    assert got is error
    assert [o.text for _, o in merged] == ["a"]

