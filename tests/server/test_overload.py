"""Overload control: beyond --max-queued-requests, new requests get 503 with Retry-After at once,
every admitted request still completes in full, and /metrics counts the rejections."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow


def test_a_burst_beyond_the_queue_bound_gets_503s_and_loses_nothing():
    server = ServerProcess("--max-queued-requests", "2")
    try:
        server.wait_ready()
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
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
    finally:
        server.stop()
