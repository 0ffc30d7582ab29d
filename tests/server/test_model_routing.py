"""The model router's HTTP side (entrypoints/openai/model_routing.py) over a fake pool: no model
loads, so what a request makes the pool do is checked in milliseconds. /api/ps's expires_at never
fails, whatever keep_alive asked for."""

from __future__ import annotations

import time

from tokenmill.entrypoints.openai.model_routing import FOREVER, expires_at
from tokenmill.frontend.model_router import ModelEntry, ModelRouter, ModelState, keep_alive_seconds


def test_expires_at_shows_a_date_or_forever_and_never_fails():
    entry = ModelEntry("a", "/m/a", ModelState.LOADED)
    router = ModelRouter([entry], idle_unload_s=None)
    router.started(entry, time.monotonic())
    assert expires_at(entry, None) == FOREVER  # busy
    router.finished(entry, time.monotonic(), keep_alive_seconds("1h"))
    soon = expires_at(entry, None)
    assert soon.endswith("Z") and soon != FOREVER and soon[:4].isdigit()
    for huge in (1e12, 1e308, "1e12"):  # too far for any clock: forever, as a negative keep_alive
        router.started(entry, time.monotonic())
        router.finished(entry, time.monotonic(), keep_alive_seconds(huge))
        assert expires_at(entry, None) == FOREVER
    entry.unload_at = time.monotonic() + 1e12  # a deadline no date can show (year 33715): forever, not a 500
    assert expires_at(entry, None) == FOREVER
    entry.unload_at = None
    assert expires_at(entry, 1e15) == FOREVER  # --idle-unload-seconds as large
