"""`--tool-call-parser` from the command line to the chat handler; an unknown name fails at start-up."""

from __future__ import annotations

import pytest

from tests.server.fake_server import FakeManager, bundled_tokenizer
from tokenmill.entrypoints import cli
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.tool_parsers import TOOL_PARSERS
from tokenmill.model.default_model import default_model_path


def test_cli_flag_reaches_the_server_config(monkeypatch):
    seen: list[ServerConfig] = []
    monkeypatch.setattr("tokenmill.entrypoints.openai.api_server.run_server", lambda config: seen.append(config) or 0)
    model = default_model_path()  # passes serve's file check; the server is not started
    assert cli.main(["serve", "--model", model, "--tool-call-parser", "hermes"]) == 0
    assert cli.main(["serve", "--model", model]) == 0
    assert [c.tool_call_parser for c in seen] == ["hermes", None]


def test_an_unknown_parser_is_a_start_up_error_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--tool-call-parser", "qwen"])
    assert exc.value.code == 2
    assert "unknown tool call parser 'qwen'; known: glm45, hermes, llama3_json, mistral" in capsys.readouterr().err
    with pytest.raises(ValueError, match="known: glm45, hermes, llama3_json, mistral"):
        build_app(ServerConfig(tool_call_parser="qwen"))


def test_the_chat_handler_gets_the_parser():
    state = ServerState()
    manager = FakeManager(bundled_tokenizer())
    state.attach(manager, ServerMetrics(lambda: None), tool_parser=TOOL_PARSERS["hermes"])  # type: ignore[arg-type]
    assert state.chat.tool_parser is TOOL_PARSERS["hermes"] and state.chat.reasoning_parser is None
    state.attach(manager, ServerMetrics(lambda: None))  # type: ignore[arg-type]
    assert state.chat.tool_parser is None
