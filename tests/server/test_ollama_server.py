"""Ollama's API through the session's shared real `tokenmill serve` on the bundled model (conftest.py:
started with --api-key, which guards /api/* as it does /v1/*), driven by the real `ollama` Python
client, unmodified: chat and generate (streamed and not), tags, ps, show, embed, a tool call
(grammar-constrained: tokenmill's `tool_choice` option), a JSON-schema format, a 501 for the model
store and Ollama's error for an unknown model."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import AUTH
from tests.frontend.conftest import bundled_gguf_path

ollama = pytest.importorskip("ollama")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
]

GREEDY = {"temperature": 0, "num_predict": 12}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120, headers=AUTH)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.list().models[0].model


def test_tags_ps_show_version(client, model, server):
    tags = client.list().models
    assert len(tags) == 1 and model.endswith(":latest") and tags[0].size > 0 and tags[0].details.format == "gguf"
    # as Ollama lists SmolLM2-135M: its file type by llama.cpp's name, its weights counted from the file
    assert (tags[0].details.quantization_level, tags[0].details.parameter_size) == ("Q4_1", "134.52M")
    running = client.ps().models
    assert running[0].model == model and running[0].expires_at is not None
    shown = client.show(model)
    assert "completion" in shown.capabilities and shown.modelinfo["general.architecture"] == "llama"
    assert "im_start" in shown.template  # SmolLM2's chat template
    assert httpx.get(f"{server.url}/api/version", headers=AUTH).json()["version"]


def test_chat_and_its_stream_agree(client, model):
    reply = client.chat(model=model, messages=CHAT, options=GREEDY)
    assert reply.done and reply.done_reason in ("stop", "length") and reply.message.role == "assistant"
    assert "Paris" in reply.message.content
    assert reply.prompt_eval_count > 5 and 0 < reply.eval_count <= 12
    assert reply.total_duration >= reply.prompt_eval_duration > 0 and reply.created_at
    chunks = list(client.chat(model=model, messages=CHAT, options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done and chunks[-1].eval_count == reply.eval_count
    assert "".join(c.message.content for c in chunks) == reply.message.content
    # options reach the sampler: num_predict cuts the output, a stop string ends it
    short = client.chat(model=model, messages=CHAT, options={"temperature": 0, "num_predict": 2})
    assert short.eval_count == 2 and short.done_reason == "length"


def test_generate_templated_raw_and_streamed(client, model):
    reply = client.generate(model=model, prompt="What is the capital of France?", options=GREEDY)
    assert reply.done and "Paris" in reply.response and reply.context
    streamed = list(client.generate(model=model, prompt="What is the capital of France?", options=GREEDY,
                                    stream=True))
    assert "".join(c.response for c in streamed) == reply.response and streamed[-1].done
    raw = client.generate(model=model, prompt="1, 2, 3, 4,", raw=True,
                          options={"temperature": 0, "num_predict": 6, "stop": [" 7"]})
    assert raw.response.startswith(" 5") and " 7" not in raw.response
    loaded = client.generate(model=model, keep_alive=0)  # Ollama's "release the model" call
    assert loaded.done and loaded.done_reason == "unload"


def test_format_json_schema(client, model):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    reply = client.chat(model=model, messages=CHAT, format=schema, options={"temperature": 0, "num_predict": 40})
    assert set(json.loads(reply.message.content)) == {"city"}


def test_tool_call(client, model):
    def get_weather(city: str) -> str:
        """Get the weather in a city.

        Args:
          city: The city name
        """
        return "sunny"

    reply = client.chat(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                        tools=[get_weather], options={"temperature": 0, "num_predict": 60, "tool_choice": "required"})
    calls = reply.message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and isinstance(calls[0].function.arguments["city"], str)
    # the round trip: the call and its result go back in Ollama's shape
    follow = client.chat(model=model, options=GREEDY, messages=[
        {"role": "user", "content": "Weather in Paris?"}, reply.message,
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}])
    assert follow.done and follow.message.content


def test_embed(client, model):
    out = client.embed(model=model, input=["Paris is in France.", "Bananas are yellow."])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) == 576 and out.prompt_eval_count > 5
    assert abs(sum(x * x for x in out.embeddings[0]) - 1) < 1e-4
    old = client.embeddings(model=model, prompt="Paris is in France.").embedding  # the older endpoint
    assert max(abs(x - y) for x, y in zip(old, out.embeddings[0])) < 1e-5


def test_errors_in_ollama_shape(client, server):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="no-such-model:7b", messages=CHAT)
    assert err.value.status_code == 404 and "no-such-model" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("llama3")
    assert err.value.status_code == 501 and "model store" in err.value.error
    r = httpx.post(f"{server.url}/api/chat", json={"messages": CHAT, "options": {"temperature": "hot"}}, headers=AUTH)
    assert r.status_code == 400 and "options.temperature" in r.json()["error"]
    # booleans are ints in Python, not token ids: a 400 here, not a request the engine cannot decode
    r = httpx.post(f"{server.url}/api/generate", json={"prompt": "hi", "context": [True, False], "stream": False},
                   headers=AUTH, timeout=30)
    assert r.status_code == 400 and "context" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as err:
        client.delete("x")
    assert err.value.status_code == 501


@pytest.mark.parametrize(("method", "path", "body", "status", "says"), [
    ("POST", "/api/chat", {"messages": CHAT, "stream": "no"}, 400, "stream must be true or false"),
    ("POST", "/api/generate", {"prompt": "hi", "raw": "yes"}, 400, "raw must be true or false"),
    ("POST", "/api/chat", {"model": 5, "messages": CHAT}, 400, "model must be a string"),
    ("POST", "/api/generate", {"prompt": "hi", "keep_alive": "banana"}, 400, "keep_alive must be"),
    ("POST", "/api/show", {}, 400, "model is required"),
    ("POST", "/api/chat", {"messages": CHAT, "options": {"tool_choice": "required"}}, 400, "needs a non-empty tools"),
    ("GET", "/api/chat", None, 405, "not allowed on /api/chat: use POST"),
    ("POST", "/api/nonexistent", {}, 404, "/api/nonexistent not found"),
])
def test_bad_requests_get_ollama_errors(server, method, path, body, status, says):
    r = httpx.request(method, f"{server.url}{path}", json=body, headers=AUTH, timeout=30)
    assert r.status_code == status and says in r.json()["error"], r.text
