"""Overload control: beyond --max-queued-requests, new requests get 503 with Retry-After at once,
every admitted request still completes in full, and /metrics counts the rejections. Then, on the
same server (destructive, last): a killed scheduler fails the stream in flight and /health, and new
requests are refused rather than queued forever."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.server_process import ServerProcess, child_pid

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-queued-requests", "2")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()  # raises if any child process outlives the server


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_a_burst_beyond_the_queue_bound_gets_503s_and_loses_nothing(server, model):
    prompt = " ".join(["the quiet river runs past the old mill"] * 40)  # a prefill long enough to queue behind

    def send(i: int) -> httpx.Response:
        body = {"model": model, "prompt": f"{i} {prompt}", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(send, range(12)))
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(served) + len(refused) == 12 and served and refused
    for r in served:  # admitted requests are untouched by the rejections around them
        assert r.json()["usage"]["completion_tokens"] == 4
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"

    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    counted = re.search(r'tokenmill:request_rejected_total\{reason="queue_full"\} (\S+)', metrics)
    assert counted and float(counted.group(1)) >= len(refused)
    assert "tokenmill:num_requests_queued_frontend 0.0" in metrics  # the queue has drained
    assert send(99).status_code == 200  # and the server serves again


# ---- destructive: keep last ---------------------------------------------------------------------
def test_killed_scheduler_fails_requests_and_health(server, model):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = iter(client.completions.create(model=model, prompt="Once upon a time", max_tokens=1000, stream=True,
                                            extra_body={"ignore_eos": True}))
    next(stream)
    os.kill(child_pid(server.proc.pid, "scheduler_process"), signal.SIGKILL)
    with pytest.raises(openai.APIError, match="scheduler"):  # the stream ends as an error, never hangs
        for _ in stream:
            pass
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/health", timeout=30).status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 503 and "scheduler" in health.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError):  # 503: new requests are refused, not queued forever
        client.completions.create(model=model, prompt="Hi", max_tokens=1)
    assert "scheduler process exited" in server.log_text()
