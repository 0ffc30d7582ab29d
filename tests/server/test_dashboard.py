"""GET /dashboard and its feed over HTTP, on the in-process app with a fake manager: the page and
script are served from the package, nothing on them points off the server, the API key guards the
page, the stream and the snapshot (header or ?api_key=), and the stream sends snapshots at its
cadence and ends when the server drains."""

from __future__ import annotations

import asyncio
import json
import re
from importlib import resources

import pytest

from tests.server.fake_server import client_of, fake_app
from tokenmill.entrypoints.openai import dashboard
from tokenmill.entrypoints.openai.dashboard import DashboardStreams, FeedsByModel

KEY = "dash-secret"


def _static(name: str) -> str:
    return resources.files("tokenmill.entrypoints.openai").joinpath("static", name).read_text()


def test_page_and_script_ship_in_the_package_and_load_nothing_from_elsewhere():
    app, _ = fake_app()
    http = client_of(app)
    page = http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert '<script src="dashboard/dashboard.js">' in page.text
    script = http.get("/dashboard/dashboard.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "v1/dashboard/stream" in script.text
    for text in (page.text, script.text):
        # No CDN, font or beacon: every URL the page uses is relative to the server.
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I)
    # The package data that setuptools ships: the files the routes read.
    assert _static("dashboard.html") == page.text and _static("dashboard.js") == script.text


def test_the_dashboard_stays_out_of_the_openapi_spec():
    app, _ = fake_app()
    paths = client_of(app).get("/openapi.json").json()["paths"]
    assert not [p for p in paths if "dashboard" in p]  # an endless stream would hang spec-driven clients


def test_snapshot_without_engine_stats_yet():
    app, _ = fake_app()
    snap = client_of(app).get("/v1/dashboard/snapshot").json()
    assert snap["status"] == "up" and snap["model"] == "fake-model"
    assert snap["engine"] is None and snap["replicas"] == []


@pytest.mark.parametrize("path", ["/dashboard", "/v1/dashboard/snapshot", "/v1/dashboard/stream"])
def test_api_key_guards_the_page_and_its_feed(path):
    app, _ = fake_app(api_key=KEY)
    http = client_of(app)
    for bad in ({}, {"params": {"api_key": "wrong"}}, {"headers": {"Authorization": "Bearer wrong"}}):
        r = http.get(path, **bad)
        assert r.status_code == 401, bad
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and "?api_key=" in error["message"]
    if path != "/v1/dashboard/stream":  # an endless stream is read below, on its generator
        assert http.get(path, params={"api_key": KEY}).status_code == 200
        assert http.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # The script is static code with no data in it: a browser fetches it without the key.
    assert http.get("/dashboard/dashboard.js").status_code == 200


def test_other_routes_still_want_the_header():
    app, _ = fake_app(api_key=KEY)
    assert client_of(app).get("/v1/models", params={"api_key": KEY}).status_code == 401


def test_stream_sends_snapshots_at_its_cadence_and_ends_when_the_server_drains():
    class Manager:
        stats = None
        limits = None
        draining = False
        num_queued = 0

        class status:  # noqa: N801 - stands in for ServerStatus.UP
            value = "up"

    manager = Manager()
    streams = DashboardStreams(FeedsByModel(lambda: manager, interval_s=0.01))

    async def read() -> list[str]:
        events = []
        async for chunk in streams.events():
            events.append(chunk)
            if len(events) == 4:
                assert streams.open == 1
                manager.draining = True
        return events

    events = asyncio.run(read())
    assert events[0].startswith("retry:") and events[-1].startswith("event: end")
    seqs = [json.loads(e.removeprefix("data: "))["seq"] for e in events[1:-1]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) == 3  # a new snapshot each tick
    assert streams.open == 0


def test_too_many_streams_get_429(monkeypatch):
    monkeypatch.setattr(dashboard, "MAX_STREAMS", 0)
    app, _ = fake_app()
    r = client_of(app).get("/v1/dashboard/stream")
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_dashboard_streams"
