"""POST /v1/embeddings through one real `tokenmill serve` on the bundled model, with the openai SDK:
float and base64 encodings agree, a batch equals its inputs sent alone, usage counts the input tokens,
bad input is a 400 naming the field, /metrics counts the requests, and no KV page stays held. The
server is the session's shared one (tests/conftest.py)."""

from __future__ import annotations

import base64
import math
import time
from array import array

import httpx
import openai
import pytest

from tests.conftest import API_KEY, AUTH
from tests.frontend.conftest import bundled_gguf_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
]

HIDDEN = 576  # SmolLM2-135M


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_float_and_base64_agree(client):
    model = client.models.list().data[0].id
    floats = client.embeddings.create(model=model, input="The cat sat on the mat.", encoding_format="float")
    b64 = client.embeddings.create(model=model, input="The cat sat on the mat.", encoding_format="base64")
    # Left to itself the SDK asks for base64 and decodes it to floats.
    default = client.embeddings.create(model=model, input="The cat sat on the mat.")
    a, b = floats.data[0].embedding, array("f", base64.b64decode(b64.data[0].embedding)).tolist()
    assert len(a) == HIDDEN and a == b == default.data[0].embedding
    assert math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-4)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 3
    assert floats.model == model


def test_batch_of_strings_and_token_ids(client, server):
    texts = ["Paris is in France.", "Bananas are yellow."]
    batch = client.embeddings.create(model=client.models.list().data[0].id, input=texts)
    assert [d.index for d in batch.data] == [0, 1]
    for text, item in zip(texts, batch.data):
        alone = client.embeddings.create(model=batch.model, input=text).data[0].embedding
        assert max(abs(x - y) for x, y in zip(alone, item.embedding)) < 1e-5
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": texts[0]}, headers=AUTH).json()["tokens"]
    by_ids = client.embeddings.create(model=batch.model, input=[ids])
    assert max(abs(x - y) for x, y in zip(by_ids.data[0].embedding, batch.data[0].embedding)) < 1e-5
    assert by_ids.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], "text"]}, "input"),
    ({"input": "x", "dimensions": 64}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [10**9]}, "input"),
    ({"input": "word " * 9000}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


def test_metrics_count_embeddings_and_no_kv_is_held(server):
    def value(text: str, name: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
        if value(text, "tokenmill:kv_cache_usage_perc") == 0.0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert value(text, "tokenmill:embedding_requests_total") >= 5
    assert value(text, "tokenmill:embedding_prompt_tokens_total") > 10
    assert value(text, "tokenmill:kv_cache_usage_perc") == 0.0
