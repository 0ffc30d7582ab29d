"""`tokenmill bench serve --peer-url`: two tiny fake OpenAI servers get the same requests in one command.

The fakes stream canned text (the second one slowly), so the test needs no model and runs in about a
second while still going through HTTP, SSE parsing and the ratio report.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tokenmill.bench.serve import peer_ratios
from tokenmill.entrypoints.cli import main


@contextlib.contextmanager
def fake_server(model: str, delay_s: float) -> Iterator[tuple[str, list[dict]]]:
    """A streaming /v1/completions that sends `max_tokens` one-word chunks, `delay_s` apart."""
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep pytest's output clean
            pass

        def do_GET(self) -> None:
            self._send(200, json.dumps({"data": [{"id": model}]}).encode(), "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["max_tokens"]
            for _ in range(n):
                time.sleep(delay_s)
                self._event({"choices": [{"index": 0, "text": " tok"}]})
            self._event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n}})
            self.wfile.write(b"data: [DONE]\n\n")

        def _event(self, payload: dict) -> None:
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        def _send(self, status: int, data: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()


def test_peer_gets_the_same_requests_and_ratios_are_reported(tmp_path, capsys):
    out = tmp_path / "serve.json"
    with fake_server("ours", 0.0) as (url, ours), fake_server("theirs", 0.05) as (peer_url, theirs):
        argv = ["bench", "serve", "--url", url, "--peer-url", peer_url, "--concurrency", "1,2", "--requests", "2",
                "--prompt-words", "6", "--output-tokens", "3", "--json", str(out)]
        assert main(argv) == 0
    # The same prompts, warm-up included; at concurrency 2 they may arrive in either order.
    assert sorted(b["prompt"] for b in ours) == sorted(b["prompt"] for b in theirs)
    assert len(ours) == len(theirs)
    assert {b["model"] for b in ours} == {"ours"} and {b["model"] for b in theirs} == {"theirs"}
    report = json.loads(out.read_text())
    assert report["settings"]["model"] == "ours" and report["peer"]["model"] == "theirs"
    assert [r["concurrency"] for r in report["peer"]["results"]] == [1, 2]
    assert all(r["output_tokens"] == 6 and r["num_errors"] == 0 for r in report["peer"]["results"])
    ratios = report["ratios"]
    assert [r["concurrency"] for r in ratios] == [1, 2]
    # The peer sleeps 50 ms per token, the first server not at all.
    assert all(r["output_tokens_per_s"] > 1 and r["ttft_p99"] < 1 for r in ratios)
    printed = capsys.readouterr().out
    assert f"peer {peer_url} model theirs" in printed and "concurrency 2: output tok/s" in printed


def test_without_peer_the_report_is_unchanged(tmp_path):
    out = tmp_path / "serve.json"
    with fake_server("ours", 0.0) as (url, _):
        assert main(["bench", "serve", "--url", url, "--concurrency", "1", "--requests", "1",
                     "--prompt-words", "4", "--output-tokens", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"settings", "results"}


def test_ratio_of_a_level_without_ttft_is_none():
    ours = {"concurrency": 4, "output_tokens_per_s": 10.0, "ttft_p99_s": None}
    assert peer_ratios(ours, {**ours, "output_tokens_per_s": 0.0, "ttft_p99_s": 2.0}) == {
        "concurrency": 4, "output_tokens_per_s": None, "ttft_p99": None}
