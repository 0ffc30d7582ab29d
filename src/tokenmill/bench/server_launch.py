"""Start a `tokenmill serve` subprocess for a benchmark and wait until /health answers 200: what the
benchmarks that measure a live server (tokenizer-stall, model-switch) share."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(serve_args: list[str], prefix: str, timeout: float = 600.0) -> tuple[subprocess.Popen, str, str]:
    """(process, base URL, log path) of `tokenmill serve --port P *serve_args`, once healthy."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix=f"tokenmill-{prefix}-", suffix=".log")
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", str(port), *serve_args]
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenmill serve exited with {proc.returncode}; log: {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url, log_path
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"tokenmill serve not healthy after {timeout:g} s; log: {log_path}")
