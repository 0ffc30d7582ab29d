"""A SIGTERM while `tokenmill serve` is still starting (its /health answering 503): the server stops,
exits 0, leaves no child process and logs no error. (The start-up handshake's future used to be
reported by asyncio as "exception was never retrieved", with a traceback, on every such stop.)"""

from __future__ import annotations

import signal
import time

import pytest

from tests.server.server_process import STARTUP_TIMEOUT_S, ServerProcess


def test_a_signal_during_start_up_stops_the_server_without_an_error():
    server = ServerProcess()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while 503 not in server.health_codes and time.monotonic() < deadline and server.proc.poll() is None:
        time.sleep(0.05)
    if 200 in server.health_codes:
        server.stop()
        pytest.skip("the server was ready before the signal could reach its start-up")
    assert 503 in server.health_codes, server.log_text()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(60)
    log = server.log_text(None)
    assert server.stop() == 0, log  # and no child process outlives it (stop checks)
    assert "never retrieved" not in log and "Traceback" not in log, log
