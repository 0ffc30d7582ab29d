"""Session fixtures shared across test modules: one real `tokenmill serve` on the bundled model and
one offline engine to compare it with.

Starting a server costs three processes each loading the model (tens of seconds on a loaded 2-core
machine), so every module that needs the default engine behind the HTTP API shares one, started with
--api-key (a test of the key sends none or a wrong one; the others send it). Modules whose flags change
the engine or whose tests end the server (speculation, data / tensor parallelism, admission bounds,
SIGTERM, a killed scheduler) start their own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def api_server_starting() -> Iterator:
    """The shared server, not yet waited for: a module may build its offline engine while it loads."""
    from tests.server.server_process import ServerProcess

    srv = ServerProcess("--api-key", API_KEY)
    try:
        yield srv
    finally:
        srv.stop()  # raises if any child process outlives the server


@pytest.fixture(scope="module")
def api_server(api_server_starting):
    # Module scope: a start-up that times out on a loaded machine fails the modules waiting then,
    # not every later one (a session fixture would cache the error); once up this returns at once.
    api_server_starting.wait_ready()
    return api_server_starting


@pytest.fixture(scope="session")
def reference_llm():
    """The offline API with the servers' engine settings (exact, 1 thread, 8192 KV tokens): what the
    server tests compare their HTTP output with. Shared; tests only generate on it."""
    from tests.real_model import make_llm

    return make_llm(kv_cache_tokens=8192, num_threads=1)
