"""Overload control and tokenizer workers, on one server with small admission bounds
(`--tokenizer-workers 2 --max-queued-requests 2 --max-num-seqs 2`).

Beyond the bounds new requests get 503 with Retry-After at once, every admitted request still
completes in full, and /metrics counts the rejections. Requests are tokenized in the workers (issue
12: same ids as in-process), a prompt certainly too long is refused before tokenizing (issue 15), and
only the scheduler maps libtorch (issue 21). Then (destructive, last): a killed scheduler fails the
stream in flight and /health, and new requests are refused rather than queued forever; when the
server stops, no tokenizer worker outlives it."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.frontend.conftest import bundled_gguf_path
from tests.server.server_process import ServerProcess, child_pid
from tokenmill.frontend.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
]

CHAT = [{"role": "user", "content": "Name a colour."}]


def spawned_children(pid: int) -> list[int]:
    """The server's multiprocessing children (tokenizer workers), found by parent pid and command line."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def maps_libtorch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--tokenizer-workers", "2", "--max-queued-requests", "2", "--max-num-seqs", "2")
    srv.workers = []
    try:
        srv.wait_ready()
        deadline = time.monotonic() + 60
        while len(srv.workers) < 2 and time.monotonic() < deadline:
            srv.workers = spawned_children(srv.proc.pid)
            time.sleep(0.2)
        yield srv
    finally:
        srv.stop()  # raises if any child process outlives the server
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in srv.workers):
        time.sleep(0.1)
    assert not [p for p in srv.workers if os.path.exists(f"/proc/{p}")], "a tokenizer worker outlived the server"


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
    # One request making more sequences than the queue ever holds (3 > 2) could never pass: a 400 that
    # says so, not a 503 the SDKs would retry.
    alone = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": model, "prompt": "hi", "max_tokens": 1, "n": 3})
    assert alone.status_code == 400 and "--max-queued-requests" in alone.json()["error"]["message"]


def test_tokenizer_workers_tokenize_refuse_huge_prompts_and_keep_torch_out(server, model):
    workers = server.workers
    assert len(workers) == 2, workers
    url = server.url
    tok = Tokenizer.from_model_path(bundled_gguf_path())

    counted = httpx.post(f"{url}/tokenize", json={"messages": CHAT}, timeout=60).json()
    assert counted["tokens"] == tok.apply_chat_template(CHAT)
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": CHAT, "max_tokens": 3, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(counted["tokens"])
    # The template ran in a worker: its durations are reported, its stamps (another clock) are not.
    seq = httpx.get(f"{url}/v1/requests/{chat.json()['id']}/timeline", timeout=30).json()["sequences"][0]
    assert seq["tokenizer"]["in_worker_process"] is True and seq["tokenizer"]["template_render_s"] > 0
    assert seq["frontend"]["template_rendered"] is None and seq["frontend"]["tokenized"] > 0

    huge = httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "word " * 200_000, "max_tokens": 1})  # 1 MB
    assert huge.status_code == 400 and "at least" in huge.json()["error"]["message"]

    prompt = " ".join(["the quiet river runs past the old mill"] * 10)

    def send(i: int) -> httpx.Response:
        body = {"model": model, "prompt": f"{i % 3} {prompt}", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=180)

    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(send, range(10)))
    served = {i: r.json() for i, r in enumerate(responses) if r.status_code == 200}
    refused = [r for r in responses if r.status_code == 503]
    assert len(served) + len(refused) == 10 and served and refused
    assert all(r.json()["error"]["code"] == "server_overloaded" for r in refused)
    for body in served.values():  # every admitted request has its whole output
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
    first = min(served)
    alone = send(first).json()  # ... the same text as when it runs alone
    assert served[first]["choices"][0]["text"] == alone["choices"][0]["text"]
    assert "admission: at most 4 live sequences" in server.log_text()
    # After serving (the workers have unpickled the serving code's functions by now):
    text_processes = [server.proc.pid, child_pid(server.proc.pid, "detokenizer_process"), *workers]
    assert [pid for pid in text_processes if maps_libtorch(pid)] == []
    assert maps_libtorch(child_pid(server.proc.pid, "scheduler_process"))  # the check sees it where it is


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
