"""The live dashboard against a real `tokenmill serve` (the session's shared one, tests/conftest.py:
bundled model, one thread, --api-key): its event stream shows the load change while requests run,
and in headless Chromium the page draws it with no console error and nothing fetched from elsewhere.

The browser is Debian's `chromium` driven by Playwright through `executable_path` (never
`playwright install`; .ci/run installs the package). Without a browser or Playwright the browser
test is skipped with the reason. The screenshot goes to the test's temporary folder, and to
docs/images/dashboard.png (the one the docs show) when TOKENMILL_DOCS_SCREENSHOT=1.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import API_KEY as KEY
from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "dashboard.png"
# A shared system prompt of several KV pages, so the prefix tree has a shared prefix to show.
SYSTEM = "You are a helpful assistant for the mill. Answer briefly and plainly, in one sentence. " * 3


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def server(api_server) -> ServerProcess:
    return api_server


class Load:
    """Chat requests from a few threads until stopped: a system prompt they share, questions they don't."""

    def __init__(self, server: ServerProcess, streams: int = 4, max_tokens: int = 24) -> None:
        self.url = f"{server.url}/v1/chat/completions"
        self.streams, self.max_tokens = streams, max_tokens
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []
        self._pool = ThreadPoolExecutor(streams)

    def __enter__(self) -> Load:
        for k in range(self.streams):
            self._pool.submit(self._run, k)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._pool.shutdown(wait=True)

    def _run(self, k: int) -> None:
        i = 0
        while not self.stop.is_set():
            body = {"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"Question {k}.{i}: what does a mill grind?"}],
                    "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
            r = httpx.post(self.url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            if r.status_code != 200:
                self.failures.append(r.text)
            self.done += 1
            i += 1


def read_events(server: ServerProcess, seconds: float) -> list[dict]:
    events = []
    deadline = time.monotonic() + seconds
    with httpx.stream("GET", f"{server.url}/v1/dashboard/stream", params={"api_key": KEY}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
            if time.monotonic() > deadline:
                break
    return events


def test_the_stream_follows_the_load(server):
    assert httpx.get(f"{server.url}/v1/dashboard/snapshot", timeout=30).status_code == 401
    with Load(server) as load:
        events = read_events(server, 5.0)
    assert not load.failures and load.done >= 4
    engines = [e["engine"] for e in events if e["engine"] is not None]
    assert len(events) >= 12  # four a second, whatever the engine is doing
    assert engines[-1]["generation_tokens_total"] > engines[0]["generation_tokens_total"]
    assert max(e["running"] for e in engines) >= 2
    assert max(e["step"]["decode_rows"] for e in engines) >= 2
    assert max(e["rates"]["generation_tokens_per_s"] for e in engines) > 0
    assert engines[-1]["step"]["count_total"] > engines[0]["step"]["count_total"]
    assert max(e["kv_pages_in_use"] for e in engines) > 0
    assert any(e["prefix_tree_top"] for e in engines), "the shared system prompt is a shared prefix"
    top = next(e["prefix_tree_top"][0] for e in reversed(engines) if e["prefix_tree_top"])
    assert top["tokens"] >= 32 and top["tokens"] % 16 == 0
    assert events[-1]["latency"]["ttft"]["count"] >= 2 and events[-1]["latency"]["itl"]["p99"] > 0
    # Once the load is over (every request finished): the window holds all of them. The snapshot is
    # built once a tick (0.25 s), and the streams' last requests all end together as the load stops,
    # so the first snapshot read may predate them: wait up to 5 s for the tick that has them.
    deadline = time.monotonic() + 5.0
    while True:
        latency = httpx.get(f"{server.url}/v1/dashboard/snapshot", params={"api_key": KEY},
                            timeout=30).json()["latency"]
        if latency["e2e"]["count"] >= load.done or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert latency["e2e"]["count"] >= load.done and latency["ttft"]["p50"] > 0
    slowest = latency["slowest"][0]
    assert slowest["e2e_s"] == latency["e2e"]["max"]
    timeline = httpx.get(server.url + slowest["timeline_url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert timeline.status_code == 200 and timeline.json()["sequences"][0]["engine"]["queue_time"] is not None


def wait_until(check, timeout: float, what: str) -> None:
    """Polls from Python: the page's CSP (no eval) refuses Playwright's wait_for_function, as it should."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def number(text: str) -> float:
    return float(text.replace(",", "").replace("–", "0") or 0)


def test_the_page_draws_the_live_load_in_chromium(server, tmp_path):
    browser_path = chromium_path()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium chromium-driver)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright is not installed (pip install playwright; the browser is Debian's chromium)")
    problems: list[str] = []
    foreign: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("response", lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.on("request", lambda r: None if r.url.startswith(server.url) else foreign.append(r.url))
            page.goto(f"{server.url}/dashboard?api_key={KEY}")
            wait_until(lambda: number(page.inner_text("#updates")) >= 2, 30, "the first snapshots")
            before = number(page.inner_text("#gen-total"))
            with Load(server) as load:
                wait_until(lambda: number(page.inner_text("#running")) >= 2, 60, "running requests on the page")
                wait_until(lambda: page.query_selector("#slowest-table a") is not None
                           and page.query_selector("#prefix-table td.empty") is None, 60,
                           "a slowest request and a shared prefix")
                time.sleep(8 if os.environ.get("TOKENMILL_DOCS_SCREENSHOT") == "1" else 3)  # chart history
                after = number(page.inner_text("#gen-total"))
                page.click("#slowest-table a")
                wait_until(lambda: "engine: queue" in page.inner_text("#timeline-body"), 30, "the timeline")
                shot = tmp_path / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
            assert not load.failures
            assert after > before
            assert page.inner_text("#status") == "up"
            assert page.inner_text("#lat-ttft td:nth-child(3)") not in ("–", "")
        finally:
            browser.close()
    assert not problems, problems
    assert not foreign, f"the page fetched from elsewhere: {foreign}"
    assert shot.stat().st_size > 10_000
    if os.environ.get("TOKENMILL_DOCS_SCREENSHOT") == "1":
        DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, DOCS_SCREENSHOT)
