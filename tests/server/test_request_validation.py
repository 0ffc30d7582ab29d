"""Bad chat requests get a 400 naming the field in plain words, and no internal exception text ever
reaches a client (issue 15): unknown roles, malformed tools, null content, lone surrogates, bugs."""

from __future__ import annotations

import pytest

from tests.server.fake_server import FakeManager, bundled_tokenizer, client_of, fake_app
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.tokenizer import Tokenizer

USER = {"role": "user", "content": "hi"}
INTERNAL_WORDS = ("TypeError", "KeyError", "AttributeError", "Traceback", "NoneType", "concatenate")


@pytest.fixture(scope="module")
def app_and_manager():
    return fake_app()


@pytest.fixture(scope="module")
def http(app_and_manager):
    with client_of(app_and_manager[0]) as client:
        yield client


def chat(http, **body):
    return http.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 2, **body})


def assert_400(resp, param: str, *words: str) -> str:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]
    assert not any(w in error["message"] for w in INTERNAL_WORDS), error["message"]
    return error["message"]


def test_unknown_role(http):
    message = assert_400(chat(http, messages=[{"role": "wizard", "content": "hi"}]), "messages",
                         "messages[0].role", "'wizard'")
    assert "'user'" in message  # says what is allowed


@pytest.mark.parametrize(
    ("tools", "where"),
    [
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "banana", "function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "function", "function": {"parameters": {}}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f"}}, {"name": "g"}], "tools[1].type"),
        (["garbage"], "tools.0"),
    ],
)
def test_malformed_tools(http, tools, where):
    assert_400(chat(http, tools=tools), "tools", where)


def test_well_formed_tools_pass(http):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {"type": "object"}}}]
    assert chat(http, tools=tools).status_code == 200


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_null_content(http, role):
    assert_400(chat(http, messages=[{"role": role, "content": None}]), "messages", "messages[0].content", "null")


@pytest.mark.parametrize("escape", [b"\\ud800", b"a\\udc00b", b"\\ud83d\\u0041"])
def test_lone_surrogate_is_a_clear_400(http, escape):
    body = b'{"messages": [{"role": "user", "content": "' + escape + b'"}]}'
    resp = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    message = assert_400_no_param(resp)
    assert "surrogate" in message and "line 1 column" in message


def assert_400_no_param(resp) -> str:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] is None
    return error["message"]


def test_paired_surrogates_are_fine(http):
    body = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    assert http.post("/v1/chat/completions", content=body).status_code == 200


def test_template_failure_does_not_leak_exception_text():
    # A template that fails inside jinja with a TypeError: the client hears what to check, never the exception.
    broken = Tokenizer(bundled_tokenizer().backend, chat_template="{{ messages[0]['content'] + 1 }}")
    state = ServerState()
    state.attach(FakeManager(broken), ServerMetrics(lambda: None))  # type: ignore[arg-type]
    with client_of(build_app(ServerConfig(), state=state)) as http:
        assert_400(chat(http), "messages", "could not render")


def test_internal_errors_are_a_500_without_their_text(app_and_manager):
    app, manager = app_and_manager
    manager.fail_with = TypeError("can only concatenate str (not 'NoneType') to str")
    try:
        with client_of(app) as http:
            for stream in (False, True):
                resp = chat(http, stream=stream)
                assert "x-request-id" in resp.headers
                assert not any(w in resp.text for w in INTERNAL_WORDS), resp.text
                if not stream:
                    assert resp.status_code == 500 and resp.json()["error"]["type"] == "internal_server_error"
                else:
                    assert "internal server error" in resp.text and resp.text.endswith("data: [DONE]\n\n")
    finally:
        manager.fail_with = None
