"""SIGTERM under load: new requests get 503 while the running ones may finish; those still running
after --shutdown-timeout end with a final "abort" chunk, an error event and [DONE]; the server exits
0 with no traceback in its log, and no child outlives it."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow


def stream_events(url: str, body: dict, events: list, started: threading.Event) -> None:
    """POSTs a streaming completion and appends each SSE data payload (parsed, or "[DONE]")."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()


def test_sigterm_drains_running_requests_then_ends_the_rest_cleanly():
    server = ServerProcess("--shutdown-timeout", "5")
    try:
        server.wait_ready()
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        base = {"model": model, "prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}
        runs = []
        for max_tokens in (2000, 2000, 8):  # two outlast the drain, one finishes inside it
            events: list = []
            started = threading.Event()
            t = threading.Thread(target=stream_events, args=(server.url, {**base, "max_tokens": max_tokens},
                                                             events, started), daemon=True)
            t.start()
            runs.append((max_tokens, events, started, t))
        for _, _, started, _ in runs:
            assert started.wait(120), server.log_text()

        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health", timeout=30).status_code != 503:
            assert time.monotonic() < deadline, "/health never said the server is shutting down"
            time.sleep(0.05)
        refused = httpx.post(f"{server.url}/v1/completions", json={**base, "max_tokens": 1}, timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_shutting_down"

        assert server.proc.wait(60) == 0  # an expected shutdown is a clean exit
        for max_tokens, events, _, t in runs:
            t.join(30)
            assert not t.is_alive() and events[-1] == "[DONE]"
            finishes = [c["choices"][0]["finish_reason"] for c in events[:-1] if c.get("choices")]
            if max_tokens == 8:
                assert finishes[-1] == "length" and "error" not in events[-2]  # finished during the drain
            else:
                assert finishes[-1] == "abort"  # a final chunk, then the error event, then [DONE]
                assert events[-2]["error"]["code"] == "server_shutting_down"
        assert "Traceback" not in server.log_text()
    finally:
        server.stop()  # raises if a child process outlived the server
