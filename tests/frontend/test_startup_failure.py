"""A child that fails at start-up: the server reports that first reason, not what followed from it (the
process's exit), and does not wait for the tokenizer's export to say so."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import zmq.asyncio

import tokenmill.frontend.tokenizer_manager as tm
from tokenmill.errors import ModelLoadError
from tokenmill.ipc.channels import IpcPaths
from tokenmill.ipc.lifecycle import startup_failure


def test_the_first_reason_is_kept_and_the_export_is_not_waited_for(tmp_path, monkeypatch):
    release = threading.Event()

    def slow_export(model, dest, niceness):  # a cold tokenizer export takes seconds
        release.wait(30)
        raise RuntimeError("the export's own failure, later")

    monkeypatch.setattr(tm, "export_tokenizer", slow_export)

    async def scenario() -> tuple[bool, float, str | None]:
        ctx = zmq.asyncio.Context()
        manager = tm.TokenizerManager(ctx, IpcPaths(str(tmp_path)), "model.gguf", metrics=None)  # type: ignore[arg-type]
        started = time.monotonic()
        task = asyncio.ensure_future(manager.start())
        await asyncio.sleep(0.2)
        manager.mark_unhealthy("the scheduler process failed: cannot load model from model.gguf: bad bytes")
        manager.on_process_exit("scheduler", 1)  # what follows from it
        ok = await task
        elapsed = time.monotonic() - started
        release.set()
        await manager.shutdown()
        ctx.destroy(linger=0)
        return ok, elapsed, manager.unhealthy_reason

    ok, elapsed, reason = asyncio.run(scenario())
    assert not ok and elapsed < 5
    assert reason == "the scheduler process failed: cannot load model from model.gguf: bad bytes"


def test_a_model_error_is_one_log_line_and_a_bug_keeps_its_traceback(caplog):
    log = logging.getLogger("test-startup")
    with caplog.at_level(logging.ERROR, logger="test-startup"):
        sent = startup_failure(log, "scheduler", ModelLoadError("m.gguf", "unsupported architecture 'mamba'"))
        assert sent.error == "cannot load model from m.gguf: unsupported architecture 'mamba'"
        assert caplog.records[-1].exc_info is None
        try:
            raise KeyError("x")
        except KeyError as exc:
            sent = startup_failure(log, "scheduler", exc)
        assert sent.error == "KeyError: 'x'" and caplog.records[-1].exc_info is not None
