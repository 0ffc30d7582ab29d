"""`tokenmill generate` and `tokenmill chat` on the bundled model."""

from __future__ import annotations

import io

import pytest

import tokenmill.model.builder as builder
from tests.real_model import _cached_load, make_llm
from tokenmill.entrypoints.cli import main
from tokenmill.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

ENGINE = ["--kv-cache-tokens", "2048", "--num-threads", "2"]


@pytest.fixture(autouse=True)
def cached_weights(monkeypatch):
    monkeypatch.setattr(builder, "load_weights", _cached_load)


def test_generate_prints_the_greedy_completion(capsys):
    prompt = "The capital of France is"
    assert main(["generate", prompt, "--max-tokens", "10", "--temperature", "0", "--ignore-eos", *ENGINE]) == 0
    printed = capsys.readouterr().out
    expected = make_llm(kv_cache_tokens=2048, precision="fast").generate(  # the CLI default
        prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0].outputs[0].text
    assert printed == expected + "\n"


def test_generate_stream_prints_the_same_text(capsys):
    args = ["generate", "1, 2, 3,", "--max-tokens", "8", "--temperature", "0", "--ignore-eos", *ENGINE]
    main(args)
    plain = capsys.readouterr().out
    main([*args, "--stream"])
    assert capsys.readouterr().out == plain


def test_generate_reports_bad_input_without_a_traceback(capsys):
    assert main(["generate", "hi", "--temperature", "-1", *ENGINE]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/no/such/model.gguf"]) == 2
    assert "/no/such/model.gguf" in capsys.readouterr().err


def test_chat_streams_replies_and_keeps_the_conversation(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("What is 2+2?\nAnd 3+3?\n/bye\n"))
    assert main(["chat", "--temperature", "0", "--max-tokens", "24", *ENGINE]) == 0
    out = capsys.readouterr().out
    assert out.count(">>> ") == 3  # two turns answered, then /bye
    replies = [part.split("\n")[0] for part in out.split(">>> ")[1:3]]
    assert all(r.strip() for r in replies)
