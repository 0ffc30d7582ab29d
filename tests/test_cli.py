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


def test_chat_survives_a_message_it_cannot_run(monkeypatch, capsys):
    too_long = "word " * 9000  # past the 8,192-token context: refused, not added to the conversation
    lines = [too_long, "caf\udce9", "/help", "What is 2+2?", "/bye"]  # \udce9: a Latin-1 byte, as Python escapes it
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", "--temperature", "0", "--max-tokens", "24", *ENGINE]) == 0
    turns = capsys.readouterr().out.split(">>> ")[1:]
    assert "error:" in turns[0] and "context length" in turns[0] and "was not added" in turns[0]
    assert "error: the text is not valid Unicode" in turns[1]
    assert turns[2].startswith("unknown command /help")
    assert turns[3].strip() and "error" not in turns[3]  # answered, with neither refused message before it
    assert len(turns) == 5


def test_serve_refuses_a_port_out_of_range(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", "70000"])
    assert exit_.value.code == 2 and "must be 0-65535" in capsys.readouterr().err
