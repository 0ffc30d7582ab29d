"""Client conformance of the HTTP layer (issue 15): GET /v1/models/{id}, x-request-id, vLLM's
/tokenize and /detokenize, the access log, and logprob `bytes` that are each token's raw bytes."""

from __future__ import annotations

import json
import logging

import openai
import pytest

from tests.server.fake_server import MAX_MODEL_LEN, MODEL, client_of, fake_app, sdk_client

EMOJI_REPLY = "Party 😀🎉 time 🙂"


@pytest.fixture(scope="module")
def app_and_manager():
    return fake_app(EMOJI_REPLY)


@pytest.fixture(scope="module")
def http(app_and_manager):
    with client_of(app_and_manager[0]) as client:
        yield client


@pytest.fixture
def tokenizer(app_and_manager):
    return app_and_manager[1].tokenizer


def test_sdk_models_retrieve_and_unknown_model_404(http):
    client = sdk_client(http)
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such/model")
    error = info.value.response.json()["error"]
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert "no-such/model" in error["message"]


def test_x_request_id_echoes_the_client_or_names_the_request(http):
    mine = http.post("/v1/chat/completions", headers={"x-request-id": "trace-42"},
                     json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "trace-42"
    own = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert own.headers["x-request-id"] == own.json()["id"]
    for resp in (http.get("/v1/models"), http.get("/health"), http.post("/v1/completions", json={"prompt": ""}),
                 http.get("/no/such/path")):
        assert resp.headers["x-request-id"].startswith("req-"), resp.url


def test_tokenize_prompt_and_messages(http, tokenizer):
    resp = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body == {"count": len(body["tokens"]), "max_model_len": MAX_MODEL_LEN,
                    "tokens": tokenizer.encode("Hello world")}
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(messages)
    no_prompt = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < chat["count"]


def test_detokenize_round_trip(http, tokenizer):
    ids = tokenizer.encode("Round trip ✓")
    resp = http.post("/detokenize", json={"tokens": ids})
    assert resp.status_code == 200 and resp.json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/detokenize", {"tokens": [1, "two"]}),
        ("/detokenize", {"tokens": [1, 2.5]}),
        ("/detokenize", {"tokens": [10**9]}),
        ("/detokenize", {"tokens": [-1]}),
        ("/detokenize", {}),
        ("/tokenize", {"prompt": 5}),
        ("/tokenize", {}),
    ],
)
def test_tokenize_bad_input_is_a_400_naming_the_field(http, path, body):
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] in ("tokens", "prompt", "messages")
    assert error["param"] in error["message"] or "prompt" in error["message"]


def test_access_log_line_per_request(http, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.access"):
        resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
        http.get("/v1/models/nope")
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenmill.access"]
    assert len(lines) == 3, lines
    usage = resp.json()["usage"]
    assert lines[0].startswith("POST /v1/completions 200 ") and " ms " in lines[0]
    assert f"prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}" in lines[0]
    assert lines[1].startswith("POST /v1/chat/completions 200 ") and "completion_tokens=" in lines[1]  # a stream
    assert lines[2].startswith("GET /v1/models/nope 404 ")


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(http, tokenizer):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    # The reply's emoji are split over several tokens: no token's bytes may be U+FFFD's.
    assert len(content) > len(EMOJI_REPLY.split())
    assert b"".join(bytes(t["bytes"]) for t in content) == EMOJI_REPLY.encode("utf-8")
    assert b"".join(bytes(t["top_logprobs"][0]["bytes"]) for t in content) == EMOJI_REPLY.encode("utf-8")
    chunks = [json.loads(line[6:]) for line in http.post("/v1/chat/completions", json={**body, "stream": True})
              .text.splitlines() if line.startswith("data: {")]
    streamed = [t for c in chunks for t in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert b"".join(bytes(t["bytes"]) for t in streamed) == EMOJI_REPLY.encode("utf-8")
