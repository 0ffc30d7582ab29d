"""`--reasoning-parser` from the command line to the chat handler; an unknown name fails at start-up."""

from __future__ import annotations

import pytest

from tests.server.fake_server import FakeManager, bundled_tokenizer
from tokenmill.entrypoints import cli
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.reasoning_parser import REASONING_PARSERS
from tokenmill.model.default_model import default_model_path


def test_cli_flag_reaches_the_server_config(monkeypatch):
    seen: list[ServerConfig] = []
    monkeypatch.setattr("tokenmill.entrypoints.openai.api_server.run_server", lambda config: seen.append(config) or 0)
    model = default_model_path()  # passes serve's file check; the server is not started
    assert cli.main(["serve", "--model", model, "--reasoning-parser", "qwen3"]) == 0
    assert cli.main(["serve", "--model", model]) == 0
    assert [c.reasoning_parser for c in seen] == ["qwen3", None]


def test_an_unknown_parser_is_a_start_up_error_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--reasoning-parser", "deepseek_r2"])
    assert exc.value.code == 2
    assert "unknown reasoning parser 'deepseek_r2'; known: deepseek_r1, qwen3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        build_app(ServerConfig(reasoning_parser="deepseek_r2"))


def test_the_chat_handler_gets_the_parser():
    state = ServerState()
    manager = FakeManager(bundled_tokenizer())
    state.attach(manager, ServerMetrics(lambda: None), REASONING_PARSERS["deepseek_r1"])  # type: ignore[arg-type]
    assert state.chat.reasoning_parser is REASONING_PARSERS["deepseek_r1"]
    state.attach(manager, ServerMetrics(lambda: None))  # type: ignore[arg-type]
    assert state.chat.reasoning_parser is None
