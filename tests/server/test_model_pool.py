"""The model pool's wiring (entrypoints/openai/model_pool.py) over fake engines: no process starts,
so the load/unload sequencing is checked in milliseconds: a busy model is never unloaded (the load
waits for room), concurrent first requests share one load, a failed load leaves nothing behind, a
broken file unloads no other model (and its retries fail at once), and idle models go after
--idle-unload-seconds or keep_alive."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai import model_pool
from tokenmill.entrypoints.openai.model_pool import ModelPool, PoolSettings
from tokenmill.frontend.load_failures import LoadFailures
from tokenmill.frontend.model_router import ModelEntry, ModelRouter, ModelState
from tokenmill.frontend.request_error import RequestError
from tokenmill.frontend.server_status import ServerStatus
from tokenmill.model.preflight import check_model_path


class FakeEngine:
    events: list[str] = []
    fail: set[str] = set()

    def __init__(self, ctx: object, entry: ModelEntry, settings: PoolSettings) -> None:
        self.name = entry.name
        self.manager = type("M", (), {"status": ServerStatus.UP, "unhealthy_reason": "it exploded"})()
        self.state = type("S", (), {"manager": self.manager, "name": entry.name})()

    async def start(self) -> bool:
        FakeEngine.events.append(f"start {self.name}")
        await asyncio.sleep(0.02)
        return self.name not in FakeEngine.fail

    def memory_bytes(self) -> int:
        return 100

    async def stop(self) -> None:
        FakeEngine.events.append(f"stop {self.name}")
        await asyncio.sleep(0.01)


checked: list[str] = []


def preflight(path: str) -> None:
    """The fake models (/m/...) pass; real files get the real checks."""
    checked.append(path)
    if not path.startswith("/m/"):
        check_model_path(path)


@pytest.fixture(autouse=True)
def fake_engines(monkeypatch):
    FakeEngine.events, FakeEngine.fail = [], set()
    checked.clear()
    monkeypatch.setattr(model_pool, "ModelEngine", FakeEngine)
    monkeypatch.setattr(model_pool, "REAP_INTERVAL_S", 0.01)
    monkeypatch.setattr(model_pool, "check_model_path", preflight)


def run(body, paths=None, **bounds):
    async def main():
        where = {n: f"/m/{n}" for n in ("a", "b", "c")} | (paths or {})
        router = ModelRouter([ModelEntry(n, p) for n, p in where.items()], **bounds)
        pool = ModelPool(zmq.asyncio.Context(), router, PoolSettings(EngineConfig()))
        pool.start()
        try:
            await body(pool, router.entries)
        finally:
            await pool.close()
            pool.ctx.destroy(linger=0)
    asyncio.run(main())


def test_a_busy_model_is_never_unloaded_and_the_load_waits_for_room():
    async def body(pool, e):
        state_a = await pool.acquire(e["a"])
        assert state_a.name == "a" and e["a"].state is ModelState.LOADED
        waiting = asyncio.ensure_future(pool.acquire(e["b"]))
        await asyncio.sleep(0.1)
        assert not waiting.done() and e["a"].state is ModelState.LOADED  # a has a request in flight
        pool.release(e["a"])
        assert (await asyncio.wait_for(waiting, 5)).name == "b"
        assert e["a"].state is ModelState.UNLOADED and FakeEngine.events == ["start a", "stop a", "start b"]
        pool.release(e["b"])
    run(body, max_loaded=1)


def test_concurrent_first_requests_share_one_load_and_a_failed_load_leaves_nothing():
    async def body(pool, e):
        states = await asyncio.gather(*(pool.acquire(e["a"]) for _ in range(5)))
        assert {s.name for s in states} == {"a"} and FakeEngine.events == ["start a"] and e["a"].in_flight == 5
        for _ in states:
            pool.release(e["a"])
        FakeEngine.fail.add("b")
        with pytest.raises(RequestError, match="'b' failed to load: it exploded") as err:
            await pool.acquire(e["b"])
        assert err.value.status == 500 and err.value.code == "model_load_failed"
        assert e["b"].state is ModelState.UNLOADED and e["b"].in_flight == 0
        assert "b" not in pool.engines and FakeEngine.events[-1] == "stop b"
        with pytest.raises(RequestError, match="'b' failed to load: it exploded"):
            await pool.acquire(e["b"])  # remembered: no second start
        assert FakeEngine.events.count("start b") == 1
    run(body)


def test_a_broken_file_unloads_nothing_and_its_retries_fail_at_once(tmp_path):
    broken = tmp_path / "b.gguf"
    broken.write_bytes(b"hello")

    async def body(pool, e):
        await pool.acquire(e["a"])
        pool.release(e["a"])
        for _ in range(2):
            with pytest.raises(RequestError, match="'b' failed to load: not a GGUF file") as err:
                await pool.acquire(e["b"])
            assert err.value.status == 500 and err.value.code == "model_load_failed"
        assert e["a"].state is ModelState.LOADED and FakeEngine.events == ["start a"]  # a stayed, b never started
        assert checked.count(str(broken)) == 1  # the retry was answered from memory
        broken.write_bytes(b"")  # the file changed: checked again, with its new problem
        with pytest.raises(RequestError, match="the file is empty"):
            await pool.acquire(e["b"])
        broken.unlink()  # deleted after start: said so
        with pytest.raises(RequestError, match="'b' failed to load: no such file or directory"):
            await pool.acquire(e["b"])
        assert e["a"].state is ModelState.LOADED and e["b"].in_flight == 0 and FakeEngine.events == ["start a"]
    run(body, paths={"b": str(broken)}, max_loaded=1)


def test_a_remembered_failure_expires(tmp_path):
    failures = LoadFailures(ttl_s=60.0)
    stamp = ((5, 1),)
    failures.remember("b", stamp, "not a GGUF file", now=100.0)
    assert failures.recall("b", stamp, 159.0) == "not a GGUF file"
    assert failures.recall("b", ((5, 2),), 110.0) is None  # another file: tried again (and forgotten)
    assert failures.recall("b", stamp, 110.0) is None
    failures.remember("b", stamp, "not a GGUF file", now=100.0)
    assert failures.recall("b", stamp, 160.0) is None  # a minute later: tried again
    assert failures.recall("a", None, 0.0) is None


def test_max_memory_holds_once_the_real_footprint_is_measured(caplog):
    # Each fake model is admitted on a 0-byte estimate (its size on disk) and measures 100 once loaded.
    async def trims(pool, e):
        for name in ("a", "b"):
            await pool.acquire(e[name])
            pool.release(e[name])
        await pool.acquire(e["a"])  # a busy: b is now the least recently used idle one
        await pool.acquire(e["c"])  # 300 > 250: b goes, never a (in flight) nor c (just loaded)
        await asyncio.sleep(0.05)
        assert [x.state for x in e.values()] == [ModelState.LOADED, ModelState.UNLOADED, ModelState.LOADED]

    async def warns(pool, e):
        await pool.acquire(e["a"])
        await pool.acquire(e["b"])  # 200 > 150 and a is busy: nothing to unload, one warning says so
        assert e["a"].state is e["b"].state is ModelState.LOADED

    with caplog.at_level("INFO", logger="tokenmill.entrypoints.openai.model_pool"):
        run(trims, max_memory=250)
        assert "unloading model b: with c loaded" in caplog.text and "over --max-memory" not in caplog.text
        run(warns, max_memory=150)
        assert caplog.text.count("over --max-memory") == 1


def test_idle_timeout_and_keep_alive_unload():
    async def body(pool, e):
        await pool.acquire(e["a"])
        await pool.acquire(e["b"])
        pool.release(e["a"], keep_alive=0)  # Ollama's keep_alive 0: unload once done
        pool.release(e["b"])  # the idle timeout (0.3 s) applies
        await asyncio.sleep(0.15)
        assert e["a"].state is ModelState.UNLOADED and e["b"].state is ModelState.LOADED
        await asyncio.sleep(0.4)
        assert e["b"].state is ModelState.UNLOADED
        await pool.acquire(e["a"])  # loaded again on its next request
        assert e["a"].state is ModelState.LOADED and FakeEngine.events.count("start a") == 2
        pool.release(e["a"], keep_alive=-1)  # never on its own, whatever the idle timeout
        await asyncio.sleep(0.4)
        assert e["a"].state is ModelState.LOADED
    run(body, idle_unload_s=0.3)


def test_draining_refuses_new_requests():
    async def body(pool, e):
        pool.draining = True
        with pytest.raises(RequestError, match="shutting down"):
            await pool.acquire(e["a"])
        assert e["a"].in_flight == 0
    run(body)
