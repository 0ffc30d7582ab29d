"""`tokenmill serve --tokenizer-workers 2` end to end (issue 12), with small admission bounds:
requests are tokenized in the workers (same ids as in-process), a prompt certainly too long is
refused before tokenizing (issue 15), a burst beyond the live bound gets 503s while every admitted
request completes in full, and no worker outlives the server. Only the scheduler maps libtorch: the
API process, the detokenizer and the workers handle text and ids (issue 21)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.frontend.conftest import bundled_gguf_path
from tests.server.server_process import ServerProcess, child_pid
from tokenmill.frontend.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

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


def test_tokenizer_workers_serve_bound_admission_and_exit_with_the_server():
    smol_path = bundled_gguf_path()
    if smol_path is None:
        pytest.skip("the bundled SmolLM2 GGUF is not installed")
    server = ServerProcess("--tokenizer-workers", "2", "--max-queued-requests", "2", "--max-num-seqs", "2")
    workers: list[int] = []
    try:
        server.wait_ready()
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = spawned_children(server.proc.pid)
            time.sleep(0.2)
        assert len(workers) == 2, workers
        url = server.url
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        tok = Tokenizer.from_model_path(smol_path)

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
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in workers):
        time.sleep(0.1)
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")]
