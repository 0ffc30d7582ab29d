"""Structured output through a real `tokenmill serve`: response_format and vLLM's guided_* fields on chat
and completions, and 400s naming the field for bad schemas (before anything is queued). The server is
the session's shared one (tests/conftest.py)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.conftest import AUTH
from tests.frontend.conftest import bundled_gguf_path

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
]

CHAT = [{"role": "user", "content": "Describe a city as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "new"]}, "maxItems": 3},
    },
    "required": ["city", "population", "tags"],
}


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=120)


def text_of(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_chat_response_format_json_schema_and_object(server):
    body = {"messages": CHAT, "max_tokens": 160, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}
    jsonschema.validate(json.loads(text_of(post(server, "/v1/chat/completions", body))), SCHEMA)
    # Free-form JSON: a prompt that the small model answers with a short object (a city makes it list
    # numbers until max_tokens).
    body["messages"] = [{"role": "user", "content": "Give me a JSON object describing a person."}]
    body["response_format"] = {"type": "json_object"}
    assert isinstance(json.loads(text_of(post(server, "/v1/chat/completions", body))), dict)


def test_completions_response_format_and_guided_fields(server):
    base = {"prompt": "Q: When did Apollo 11 land?\nA:", "max_tokens": 40, "temperature": 0}
    date = text_of(post(server, "/v1/completions", {**base, "guided_regex": r"\d{4}-\d{2}-\d{2}"}))
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date)
    choice = text_of(post(server, "/v1/completions", {**base, "guided_choice": ["yes", "no"]}))
    assert choice in ("yes", "no")
    grammar = text_of(post(server, "/v1/completions", {**base, "guided_grammar": 'root ::= [0-9]+ " AD"'}))
    assert re.fullmatch(r"[0-9]+ AD", grammar)
    guided = text_of(post(server, "/v1/completions", {**base, "max_tokens": 160, "guided_json": SCHEMA}))
    jsonschema.validate(json.loads(guided), SCHEMA)
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    jsonschema.validate(json.loads(text_of(post(server, "/v1/completions", {**base, "max_tokens": 160,
                                                                           "response_format": rf}))), SCHEMA)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                      "json_schema": {"schema": {"type": "nonsense"}}}},
         "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
        ("/v1/chat/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        ("/v1/completions", {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
        ("/v1/completions", {"guided_choice": []}, "guided_choice"),
        ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_constraints_get_400_naming_the_field(server, path, extra, param):
    body = {"messages": CHAT} if "chat" in path else {"prompt": "x"}
    resp = post(server, path, {**body, **extra})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
