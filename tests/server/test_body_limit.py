"""--max-request-bytes (issue 15): an oversized body gets 413 in OpenAI's format before it is read in
full, whether it declares its length or comes chunked; bodies under the limit are served."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.server.fake_server import client_of, fake_app
from tokenmill.entrypoints import cli
from tokenmill.entrypoints.openai.api_server import ServerConfig
from tokenmill.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BYTES
from tokenmill.model.default_model import default_model_path

LIMIT = 1000


@pytest.fixture(scope="module")
def app():
    return fake_app(max_request_bytes=LIMIT)[0]


def scope(headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers],
            "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}


def call(app, headers, receive) -> tuple[int, dict, dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope(headers), receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), json.loads(body)


def assert_413(status: int, headers: dict, body: dict) -> None:
    assert status == 413
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert f"{LIMIT} bytes" in error["message"] and "--max-request-bytes" in error["message"]
    assert b"x-request-id" in headers


def test_declared_length_over_the_limit_is_refused_unread(app):
    async def receive() -> dict:
        raise AssertionError("the body was read")

    assert_413(*call(app, [(b"content-length", str(20 * 2**20).encode())], receive))


def test_chunked_body_stops_being_read_past_the_limit(app):
    reads = 0

    async def receive() -> dict:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 100, "more_body": True}  # endless

    assert_413(*call(app, [(b"transfer-encoding", b"chunked")], receive))
    assert reads == LIMIT // 100 + 1


def test_bodies_under_the_limit_are_served_and_over_it_refused(app):
    with client_of(app) as http:
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        big = http.post("/v1/completions", json={"prompt": "x" * LIMIT})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


def test_cli_flag_reaches_the_server_config(monkeypatch):
    seen: list[ServerConfig] = []
    monkeypatch.setattr("tokenmill.entrypoints.openai.api_server.run_server", lambda config: seen.append(config) or 0)
    model = default_model_path()  # passes serve's file check; the server is not started
    assert cli.main(["serve", "--model", model, "--max-request-bytes", "12345"]) == 0
    assert cli.main(["serve", "--model", model]) == 0
    assert [c.max_request_bytes for c in seen] == [12345, DEFAULT_MAX_REQUEST_BYTES]
    with pytest.raises(SystemExit):
        cli.main(["serve", "--max-request-bytes", "0"])
