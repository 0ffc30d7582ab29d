"""A real `tokenmill serve` subprocess for end-to-end tests: start, wait for /health, stop, and
check that no child process outlives it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

# Three processes load the model and tokenizers at once on a shared 2-core machine (over 400 s seen
# with a load average of 20: TOKENMILL_TEST_STARTUP_TIMEOUT raises it there).
STARTUP_TIMEOUT_S = float(os.environ.get("TOKENMILL_TEST_STARTUP_TIMEOUT", "240"))
# exact: the server tests compare with offline results of tests/real_model.make_llm (exact by default).
SMALL_ENGINE = ["--kv-cache-tokens", "8192", "--num-threads", "1", "--precision", "exact"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokenmill_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "tokenmill")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "tokenmill.entrypoints.cli"]


def children_of(pid: int) -> list[int]:
    """Child processes of the server, found by the --parent-pid it passes them, so they are found
    even after an unclean exit would have re-parented them to init."""
    marker = f"--parent-pid\0{pid}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker in cmdline + b"\0":
            found.append(int(entry))
    return found


def child_pid(pid: int, role: str) -> int:
    for child in children_of(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if role.encode() in f.read():
                return child
    raise LookupError(f"no {role} process under {pid}")


def _ipc_dir(pid: int) -> str | None:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().decode().split("\0")
    return args[args.index("--ipc-dir") + 1] if "--ipc-dir" in args else None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except OSError:
        return False


class ServerProcess:
    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="tokenmill-serve-", suffix=".log")
        cmd = [*tokenmill_command(), "--log-level", "INFO", "serve", "--port", str(self.port), *SMALL_ENGINE, *extra]
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.health_codes: list[int] = []  # every /health status seen until the first 200
        self.children: list[int] = []
        self.ipc_dir: str | None = None
        # Polled from the start in the background, so the 503s of start-up are seen even while the
        # test process is busy (e.g. loading the offline model to compare against).
        self._healthy = threading.Event()
        threading.Thread(target=self._poll_health, daemon=True).start()

    def _poll_health(self) -> None:
        while self.proc.poll() is None:
            try:
                code = httpx.get(f"{self.url}/health", timeout=30).status_code
            except httpx.HTTPError:
                code = None
            if code is not None:
                self.health_codes.append(code)
                if code == 200:
                    self._healthy.set()
                    return
            time.sleep(0.2)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self._healthy.wait(0.25):
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with {self.proc.returncode}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tokenmill serve not healthy after {timeout}s:\n{self.log_text()}")
        self.children = children_of(self.proc.pid)
        self.ipc_dir = _ipc_dir(self.children[0]) if self.children else None

    def log_text(self, tail: int | None = 6000) -> str:
        """The log's last `tail` characters (enough for an error message), or all of it with None (a
        server shared by several modules logs a line per request after its start-up lines)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-tail:] if tail else f.read()
        except FileNotFoundError:
            return "(log removed)"

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; returns the exit status. Raises if the server or any child survives."""
        known = set(self.children) | set(children_of(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"tokenmill serve ignored SIGTERM:\n{self.log_text()}") from None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in known):
            time.sleep(0.1)
        left = [p for p in known if alive(p)] + children_of(self.proc.pid)
        if left:
            for p in left:
                os.kill(p, signal.SIGKILL)
            raise RuntimeError(f"child processes {left} outlived the server:\n{self.log_text()}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log_path)  # kept only when something went wrong
        return code
