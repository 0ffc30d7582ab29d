"""End to end: `tokenmill serve --data-parallel-size 2` (two engines of 1 thread each) on the bundled model.

Concurrent requests are served by both replicas with the offline API's greedy output; n > 1 samples
share one replica; then one replica's scheduler is SIGKILLed: its streams end with an error while
the other replica keeps serving, /health says degraded (still 200), /metrics labels each replica.
The kill is destructive and runs last.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.frontend.conftest import bundled_gguf_path
from tests.server.server_process import ServerProcess, children_of
from tokenmill.sample.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
]

PROMPTS = ["The history of the printing press begins", "Once upon a time, in a small village",
           "The three primary colors are", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def starting_server():
    srv = ServerProcess("--data-parallel-size", "2", "--load-balance-method", "round_robin")
    try:
        yield srv
    finally:
        srv.stop()  # raises if any replica's process outlives the server


@pytest.fixture(scope="module")
def llm(starting_server, reference_llm):
    return reference_llm  # built while the server loads, if not yet


@pytest.fixture(scope="module")
def server(starting_server, llm) -> ServerProcess:
    starting_server.wait_ready()
    return starting_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def complete(server: ServerProcess, prompt: str, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.0, **extra}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def replica_of_stream(server: ServerProcess, request_id: str) -> int:
    resp = httpx.get(f"{server.url}/v1/requests/{request_id}/timeline", timeout=30)
    return resp.json()["sequences"][0]["replica"]


def child_cmdlines(server: ServerProcess) -> dict[int, str]:
    found = {}
    for pid in children_of(server.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            found[pid] = f.read().decode().replace("\0", " ")
    return found


def test_one_scheduler_and_detokenizer_per_replica(server):
    cmdlines = list(child_cmdlines(server).values())
    schedulers = [c for c in cmdlines if "scheduler_process" in c]
    assert len(schedulers) == 2 and sum("detokenizer_process" in c for c in cmdlines) == 2
    assert all('"num_threads": 1' in c for c in schedulers)  # --num-threads 1 split: at least 1 each


def test_concurrent_requests_use_both_replicas_with_the_offline_greedy_output(server, llm):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda p: complete(server, p), PROMPTS))
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    assert [r.json()["choices"][0]["text"] for r in responses] == [e.outputs[0].text for e in expected]
    assert {r.headers["x-tokenmill-replica"] for r in responses} == {"0", "1"}


def test_n_samples_share_one_replica(server):
    resp = complete(server, PROMPTS[0], n=3, temperature=0.8, seed=1)  # round robin per sequence would split
    assert resp.headers["x-tokenmill-replica"] in ("0", "1")
    sequences = httpx.get(f"{server.url}/v1/requests/{resp.json()['id']}/timeline", timeout=30).json()["sequences"]
    assert len(sequences) == 3 and len({seq["replica"] for seq in sequences}) == 1
    assert len(resp.json()["choices"]) == 3


def test_metrics_have_a_series_per_replica(server):
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for replica in ("0", "1"):
        assert f'tokenmill:replica_up{{replica="{replica}"}} 1.0' in text
        assert f'tokenmill:num_requests_running{{replica="{replica}"}}' in text
        assert f'tokenmill:generation_tokens_total{{replica="{replica}"}}' in text
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "replicas_live": 2, "replicas_total": 2}


# ---- destructive: keep last -------------------------------------------------------------------------
def test_killed_replica_fails_its_requests_and_the_other_keeps_serving(server, client, model):
    streams, responses, extra = {}, {}, []
    for _ in range(6):  # one long stream on each replica (the router alternates, probes included)
        response = client.completions.create(model=model, prompt="Once upon a time", max_tokens=1000,
                                             stream=True, extra_body={"ignore_eos": True})
        stream = iter(response)
        replica = replica_of_stream(server, next(stream).id)
        (extra if replica in streams else []).append(response)
        streams.setdefault(replica, stream)
        responses.setdefault(replica, response)
        if len(streams) == 2:
            break
    for response in extra:
        response.close()  # only one stream per replica keeps the engines busy
    assert set(streams) == {0, 1}
    victim = next(pid for pid, cmd in child_cmdlines(server).items() if cmd.endswith("--replica 1 "))
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="replica 1"):  # ends as an error, never hangs
        for _ in streams[1]:
            pass
    for _ in range(3):  # the other replica's stream keeps producing
        assert next(streams[0]).choices[0].text is not None
    # The response, not its iterator: closing a generator leaves the connection open, and the request
    # would run on until the server's drain (20 s) at the module's end.
    responses[0].close()
    deadline = time.monotonic() + 10
    while "tokenmill:num_requests_running{replica=\"0\"} 0.0" not in httpx.get(f"{server.url}/metrics", timeout=30).text:
        assert time.monotonic() < deadline, "the closed stream's request still runs on replica 0"
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while (health := httpx.get(f"{server.url}/health", timeout=30)).json().get("replicas_live") != 1:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    for prompt in PROMPTS[:3]:  # every new request goes to the live replica and succeeds
        assert complete(server, prompt).headers["x-tokenmill-replica"] == "0"
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert 'tokenmill:replica_up{replica="1"} 0.0' in text and 'tokenmill:replica_up{replica="0"} 1.0' in text
