"""Two models behind one real `tokenmill serve` (the model router: entrypoints/openai/model_pool.py),
driven by the real `openai` SDK and `ollama` client, unmodified: the bundled SmolLM2 GGUF and a tiny
random-weight llama saved as a HF folder. Neither is loaded at start; requests to both, interleaved
and concurrent, are each answered by the model they named (SmolLM2 by its greedy answer, the tiny
one by its own offline greedy output); keep_alive 0 unloads a model and its next request loads it
again; embeddings come from the model named; unknown names get the 404 of each protocol; /metrics, /health, /api/ps and timelines name
the model (the dashboard: the one ?model= names, else the most recently used one)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.frontend.conftest import bundled_gguf_path
from tests.server.server_process import ServerProcess, children_of

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
]

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TINY_PROMPT = [1, 504, 3458, 282, 4649, 314]  # token ids: both models share SmolLM2's vocabulary
TINY_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    from tests.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("router"), "llama", seed=3))


@pytest.fixture(scope="module")
def tiny_reference(tiny_folder) -> str:
    """The tiny model's own greedy text for TINY_PROMPT, offline (no server)."""
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sample.sampling_params import SamplingParams

    llm = LLM(tiny_folder, precision="exact", kv_cache_tokens=1024, num_threads=1)
    out = llm.generate({"prompt_token_ids": TINY_PROMPT}, SamplingParams(max_tokens=TINY_TOKENS, temperature=0.0,
                                                                        ignore_eos=True))
    return out[0].outputs[0].text


@pytest.fixture(scope="module")
def server(tiny_folder):
    srv = ServerProcess("--model", f"smol={bundled_gguf_path()}", "--model", f"tiny={tiny_folder}")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def oll(server):
    return ollama.Client(host=server.url, timeout=600)


def loaded(server) -> dict[str, bool]:
    return {m["id"]: m["loaded"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]}


def tiny_completion(oai) -> str:
    done = oai.completions.create(model="tiny", prompt=TINY_PROMPT, max_tokens=TINY_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert done.model == "tiny"
    return done.choices[0].text


def test_nothing_loads_before_a_request_and_unknown_names_get_404(server, oai, oll):
    assert loaded(server) == {"smol": False, "tiny": False}
    assert httpx.get(f"{server.url}/health", timeout=30).json()["models"] == {"smol": "unloaded", "tiny": "unloaded"}
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="nope", messages=CHAT)
    assert err.value.code == "model_not_found" and "'smol', 'tiny'" in err.value.message
    with pytest.raises(ollama.ResponseError) as oerr:
        oll.chat(model="nope", messages=CHAT)
    assert oerr.value.status_code == 404 and "not found" in oerr.value.error
    reply = httpx.post(f"{server.url}/v1/messages", json={"model": "nope", "max_tokens": 4, "messages": CHAT}, timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"
    bad = httpx.post(f"{server.url}/api/generate", json={"model": "tiny", "keep_alive": "soon"}, timeout=30)
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
    assert loaded(server) == {"smol": False, "tiny": False}  # neither an unknown name nor bad input loads


def test_interleaved_clients_each_get_their_own_model(server, oai, oll, tiny_reference):
    def smol_openai() -> tuple[str, str]:
        done = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=12, temperature=0)
        return "smol", done.choices[0].message.content

    def smol_ollama() -> tuple[str, str]:
        return "smol", oll.chat(model="smol", messages=CHAT, options={"temperature": 0, "num_predict": 12}).message.content

    def tiny_openai() -> tuple[str, str]:
        return "tiny", tiny_completion(oai)

    def tiny_ollama_stream() -> tuple[str, str]:
        chunks = oll.generate(model="tiny:latest", prompt="", context=TINY_PROMPT, raw=True, stream=True,
                              options={"temperature": 0, "num_predict": TINY_TOKENS})
        return "tiny-ollama", "".join(c.response for c in chunks)

    calls = [smol_openai, tiny_openai, smol_ollama, tiny_ollama_stream] * 2
    with ThreadPoolExecutor(len(calls)) as pool:  # both models load at once, under concurrent requests
        answers = list(pool.map(lambda f: f(), calls))
    smol = [text for who, text in answers if who == "smol"]
    assert all("Paris" in text for text in smol) and len(set(smol)) == 1  # greedy: one answer, every client
    assert [text for who, text in answers if who == "tiny"] == [tiny_reference] * 2
    streamed = [text for who, text in answers if who == "tiny-ollama"]
    assert len(set(streamed)) == 1 and "Paris" not in streamed[0]  # random weights: never SmolLM2's answer
    assert loaded(server) == {"smol": True, "tiny": True}
    names = {m.model for m in oll.ps().models}
    assert names == {"smol:latest", "tiny:latest"}


def test_keep_alive_zero_unloads_and_the_next_request_loads_it_again(server, oai, oll, tiny_reference):
    unloading = oll.generate(model="tiny", prompt="hi", keep_alive=0, options={"num_predict": 1})
    assert unloading.load_duration < 1e9  # loaded already: no wait (Ollama's load_duration, ns)
    deadline = time.monotonic() + 60
    while loaded(server)["tiny"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert loaded(server) == {"smol": True, "tiny": False}
    assert {m.model for m in oll.ps().models} == {"smol:latest"}
    # smol keeps serving while tiny loads again
    with ThreadPoolExecutor(2) as pool:
        tiny = pool.submit(tiny_completion, oai)
        smol = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=12, temperature=0)
        assert "Paris" in smol.choices[0].message.content
        assert tiny.result() == tiny_reference
    assert loaded(server) == {"smol": True, "tiny": True}
    tiny_card = next(m for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"] if m["id"] == "tiny")
    assert tiny_card["loads"] == 2 and tiny_card["load_seconds"] > 0 and tiny_card["memory_bytes"] > 0


def test_embeddings_come_from_the_model_named(server, oai, oll):
    # each model's own width: SmolLM2's hidden size is 576, the tiny llama's 64
    assert len(oll.embed(model="tiny", input="a river mill").embeddings[0]) == 64
    assert len(oai.embeddings.create(model="smol", input="a river mill").data[0].embedding) == 576


def test_metrics_health_and_timelines_name_the_model(server, oai):
    done = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=2, temperature=0)
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert 'tokenmill:model_loaded{model="smol"} 1.0' in text and 'tokenmill:model_loaded{model="tiny"} 1.0' in text
    for model in ("smol", "tiny"):
        assert f'tokenmill:generation_tokens_total{{model="{model}"}}' in text
    assert text.count("# TYPE tokenmill:generation_tokens_total counter") == 1  # one family, a series per model
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok", "models": {"smol": "loaded", "tiny": "loaded"}}
    timeline = httpx.get(f"{server.url}/v1/requests/{done.id}/timeline", timeout=30).json()
    assert timeline["model"] == "smol" and timeline["sequences"][0]["model"] == "smol"
    # the dashboard shows the most recently used model, or the loaded one ?model= names
    assert httpx.get(f"{server.url}/v1/dashboard/snapshot", timeout=30).json()["model"] == "smol"
    tiny_view = httpx.get(f"{server.url}/v1/dashboard/snapshot", params={"model": "tiny"}, timeout=30).json()
    assert tiny_view["model"] == "tiny"
    unknown = httpx.get(f"{server.url}/v1/dashboard/snapshot", params={"model": "nope"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a loaded model its priority back needs CAP_SYS_NICE")
def test_loaded_models_run_at_normal_priority_again(server, oai):
    tiny_completion(oai)  # both loaded (they are already when the whole module runs)
    oai.completions.create(model="smol", prompt="Hi", max_tokens=1)
    assert loaded(server) == {"smol": True, "tiny": True}
    children = children_of(server.proc.pid)
    assert len(children) == 4  # a scheduler and a detokenizer per model
    for pid in children:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                assert int(f.read().rsplit(")", 1)[1].split()[16]) == 0  # field 19: nice
