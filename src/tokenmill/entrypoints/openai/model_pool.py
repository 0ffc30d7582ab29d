"""The model router's processes: one scheduler + detokenizer pair per loaded model, started on the
model's first request and stopped when the policy (frontend/model_router.py) says it must go.

    client --HTTP--> API process: model_routing.py picks the model by the body's `model`
                        | ModelPool.acquire(name): loads it if needed, counts the request in flight
                        v
                      that model's ServerState (TokenizerManager, ChatServing, ...)
                        | the same AddRequest / AbortRequest messages as with one model
                        v
                      that model's scheduler process --> its detokenizer process

Each model's pair lives in its own IPC directory and its own sockets (created and closed here), so
a model's messages can never reach another model's requests. A load runs on the event loop as
asyncio tasks (tokenizer export in a thread, children as subprocesses), so the loaded models keep
serving while it runs; concurrent first requests share one load. A load first checks the file
(model/preflight.py, in a thread) and only then makes room: a file that cannot be a model never
unloads another; a failed load is remembered (frontend/load_failures.py), so its retries get the
same 500 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.processes import ChildProcesses
from tokenmill.entrypoints.openai.server_state import ServerState
from tokenmill.errors import ModelLoadError
from tokenmill.frontend.live_bound import install_live_bound
from tokenmill.frontend.load_failures import LoadFailures
from tokenmill.frontend.model_router import ModelEntry, ModelRouter, ModelState
from tokenmill.frontend.reasoning_parser import ReasoningParser
from tokenmill.frontend.request_error import RequestError
from tokenmill.frontend.server_status import ServerStatus
from tokenmill.frontend.tokenizer_manager import TokenizerManager
from tokenmill.frontend.tool_parsers import ToolParser
from tokenmill.ipc.channels import MAIN, SCHEDULER, AsyncReceiver, IpcPaths, Sender
from tokenmill.ipc.messages import ToMain
from tokenmill.model.file_stamp import FileStamp, file_stamp
from tokenmill.model.preflight import check_model_path

logger = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.25  # how often idle models are checked against their deadlines
# Niceness of a model's processes while they load (their threads get 0 back once it is up).
LOAD_NICENESS = 10
# A load waiting for room (every loaded model busy) gives up after this long with a 503.
ROOM_WAIT_S = 120.0


@dataclass(frozen=True)
class PoolSettings:
    """What every model's engine shares (the server's flags); the model path is each model's own."""

    engine: EngineConfig
    log_level: str = "WARNING"
    max_queued_requests: int | None = None
    chat_template: str | None = None
    reasoning_parser: ReasoningParser | None = None
    tool_parser: ToolParser | None = None


def renice(pids: list[int], niceness: int) -> None:
    """Every thread of each process to `niceness` (Linux: a priority is per thread). Lowering it needs
    CAP_SYS_NICE: without it the model keeps its load priority, which only matters against other
    work on the machine (every model loads, and so stays, at the same one)."""
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
            except ProcessLookupError:
                pass
            except PermissionError:
                logger.warning("cannot restore the priority of a loaded model's process %d (no CAP_SYS_NICE): "
                               "it stays at niceness %d", pid, os.getpriority(os.PRIO_PROCESS, tid))
                return


def load_failed(entry: ModelEntry, reason: str) -> RequestError:
    """500, as Ollama answers a load error: a broken file is not a retryable 503."""
    return RequestError(f"the model {entry.name!r} failed to load: {reason}", 500, "model", "model_load_failed")


class ModelEngine:
    """One loaded model: its IPC directory, sockets, child processes and ServerState."""

    def __init__(self, ctx: zmq.asyncio.Context, entry: ModelEntry, settings: PoolSettings) -> None:
        self.name = entry.name
        self.paths = IpcPaths.create()
        self.inbox = AsyncReceiver(ctx, self.paths.address(MAIN), ToMain)
        self.outbox = Sender(ctx, self.paths.address(SCHEDULER))
        self.state = state = ServerState()
        metrics = ServerMetrics(lambda: state.manager.stats, lambda: state.manager.num_queued)
        manager = TokenizerManager(ctx, self.paths, entry.path, metrics, settings.max_queued_requests,
                                   (self.inbox, self.outbox), settings.chat_template)
        state.attach(manager, metrics, settings.reasoning_parser, settings.tool_parser)
        self.engine = dataclasses.replace(settings.engine, model=os.path.abspath(entry.path))
        self.children = ChildProcesses(self.paths, self.engine, entry.name, settings.log_level)
        self._watch: asyncio.Task | None = None

    @property
    def manager(self) -> TokenizerManager:
        return self.state.manager

    async def start(self) -> bool:
        """Start the pair and wait for the handshake and a one-token request (as a server start does).
        The pair loads at a lower CPU priority, so that on a busy machine the loaded models' streams
        keep their cores (the load takes longer instead); once up, it gets its normal priority back."""
        self.children.niceness = LOAD_NICENESS
        self.children.start()
        self._watch = asyncio.create_task(self.children.watch(self.manager.on_process_exit))
        ok = await self.manager.start(LOAD_NICENESS) and install_live_bound(self.manager, self.engine.max_num_seqs)
        if ok:
            self.state.chat.choose_tool_parser()
            renice([proc.pid for proc in self.children.procs.values()], 0)
        return ok

    def memory_bytes(self) -> int:
        """Resident memory of the model's two processes (what unloading it gives back)."""
        page = os.sysconf("SC_PAGE_SIZE")
        total = 0
        for proc in self.children.procs.values():
            try:
                with open(f"/proc/{proc.pid}/statm") as f:
                    total += int(f.read().split()[1]) * page
            except (OSError, ValueError, IndexError):
                pass
        return total

    async def stop(self) -> None:
        await self.manager.shutdown()
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await asyncio.to_thread(self.children.terminate)
        self.inbox.sock.close(linger=0)
        self.outbox.sock.close(linger=0)
        self.paths.remove()


class ModelPool:
    """Loads, tracks and unloads the models of one server as the router's policy decides."""

    def __init__(self, ctx: zmq.asyncio.Context, router: ModelRouter, settings: PoolSettings) -> None:
        self.ctx = ctx
        self.router = router
        self.settings = settings
        self.engines: dict[str, ModelEngine] = {}
        self.draining = False
        self._loads: dict[str, asyncio.Task[None]] = {}
        self._unloads: dict[str, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()  # pulsed whenever a request finishes or a model changes state
        self._reaper: asyncio.Task | None = None
        self.failures = LoadFailures()

    def start(self) -> None:
        """On the server's event loop: the idle reaper starts."""
        self._reaper = asyncio.create_task(self._reap())

    # ---- requests ---------------------------------------------------------------------------------
    async def acquire(self, entry: ModelEntry) -> ServerState:
        """The model's state, once it is loaded (loading it if needed); the request counts as in
        flight from here, so nothing unloads the model under it. Pair with release()."""
        if self.draining:
            raise RequestError("the server is shutting down; send the request to another server", 503,
                               code="server_shutting_down")
        self.router.started(entry, time.monotonic())
        try:
            while entry.state is not ModelState.LOADED:
                if entry.state is ModelState.UNLOADING:
                    await asyncio.shield(self._unloads[entry.name])
                    continue
                if entry.state is ModelState.UNLOADED and entry.name not in self._loads:
                    self._loads[entry.name] = asyncio.create_task(self._load(entry))
                # Shielded: a client leaving does not cancel a load that others may be waiting for.
                await asyncio.shield(self._loads[entry.name])
            state = self.engines[entry.name].state
        except BaseException:
            self.release(entry)
            raise
        if state.manager.status is ServerStatus.UNHEALTHY and entry.in_flight == 1:
            # Its process died while it sat idle: start it again rather than answer 503 until restarted.
            logger.warning("model %s is unhealthy (%s): loading it again", entry.name, state.manager.unhealthy_reason)
            self._begin_unload(entry)
            self.release(entry)
            return await self.acquire(entry)
        return state

    def release(self, entry: ModelEntry, keep_alive: float | None = None) -> None:
        self.router.finished(entry, time.monotonic(), keep_alive)
        self._pulse()

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- loading and unloading ------------------------------------------------------------------
    async def _load(self, entry: ModelEntry) -> None:
        engine: ModelEngine | None = None
        try:
            stamp = await self._preflight(entry)  # before _make_room: a bad file evicts nothing
            await self._make_room(entry)  # entry is LOADING from the moment its room is reserved
            tic = time.monotonic()
            engine = self.engines[entry.name] = ModelEngine(self.ctx, entry, self.settings)
            logger.info("loading model %s from %s", entry.name, entry.path)
            if not await engine.start():
                raise self._failed(entry, stamp, engine.manager.unhealthy_reason or "it did not start")
            self.failures.forget(entry.name)
            entry.memory_bytes = engine.memory_bytes() or entry.memory_bytes
            entry.loads += 1
            entry.load_seconds = time.monotonic() - tic
            entry.state = ModelState.LOADED
            logger.info("loaded model %s in %.1f s (%.0f MiB resident)", entry.name, entry.load_seconds,
                        entry.memory_bytes / 2**20)
            self._trim_to_memory(entry)
        except BaseException:
            if engine is not None:  # no half-started processes or sockets stay behind
                self.engines.pop(entry.name, None)
                await asyncio.shield(engine.stop())
            entry.state = ModelState.UNLOADED
            raise
        finally:
            self._loads.pop(entry.name, None)
            self._pulse()

    async def _preflight(self, entry: ModelEntry) -> FileStamp:
        """The file's stamp, once it passed the torch-free checks; a load that failed on this very
        file within the last minute fails again here at once."""
        stamp = file_stamp(entry.path)
        reason = self.failures.recall(entry.name, stamp, time.monotonic())
        if reason is not None:
            raise load_failed(entry, reason)
        try:
            await asyncio.to_thread(check_model_path, entry.path)  # reads the GGUF header: off the loop
        except ModelLoadError as exc:
            raise self._failed(entry, stamp, exc.problem) from None
        return stamp

    def _failed(self, entry: ModelEntry, stamp: FileStamp, reason: str) -> RequestError:
        logger.warning("model %s failed to load: %s (retries within %.0f s get this answer)", entry.name, reason,
                       self.failures.ttl_s)
        self.failures.remember(entry.name, stamp, reason, time.monotonic())
        return load_failed(entry, reason)

    async def _make_room(self, entry: ModelEntry) -> None:
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            victims = self.router.evictions(entry)
            if victims is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestError(f"the model {entry.name!r} cannot be loaded: every loaded model has requests "
                                   "in flight and the bounds (--max-loaded-models / --max-memory) allow no more; "
                                   "retry later", 503, "model", "model_capacity",
                                   headers={"Retry-After": "5"})
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, 1.0))
        entry.state = ModelState.LOADING  # resident from now on: a concurrent load counts it
        for victim in victims:
            logger.info("unloading model %s to make room for %s", victim.name, entry.name)
            self._begin_unload(victim)
        await asyncio.gather(*(asyncio.shield(self._unloads[v.name]) for v in victims if v.name in self._unloads))

    def _trim_to_memory(self, loaded: ModelEntry) -> None:
        """The estimate it was admitted on was its size on disk: with its real footprint known, unload
        idle models until the resident total fits --max-memory (model_router.py says the rule)."""
        victims, fits = self.router.trim_to_memory(loaded)
        for victim in victims:
            logger.info("unloading model %s: with %s loaded (%.0f MiB measured) the resident total exceeds "
                        "--max-memory", victim.name, loaded.name, loaded.memory_bytes / 2**20)
            self._begin_unload(victim)
        if not fits:
            total = sum(e.memory_bytes for e in self.router.resident() if e not in victims)
            logger.warning("the loaded models take %.0f MiB, over --max-memory (%.0f MiB), and no other model is idle "
                           "to unload: the bound is exceeded until one is", total / 2**20,
                           (self.router.max_memory or 0) / 2**20)

    def _begin_unload(self, entry: ModelEntry) -> None:
        """Marks it unloading at once (so no new request and no other load picks it), stops it in a task."""
        if entry.state is not ModelState.LOADED:
            return
        entry.state = ModelState.UNLOADING
        self._unloads[entry.name] = asyncio.create_task(self._unload(entry))

    async def _unload(self, entry: ModelEntry) -> None:
        try:
            engine = self.engines.pop(entry.name, None)
            if engine is not None:
                await engine.stop()
        finally:
            entry.state = ModelState.UNLOADED
            entry.unload_at = None
            self._unloads.pop(entry.name, None)
            logger.info("unloaded model %s", entry.name)
            self._pulse()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            for entry in self.router.expired(time.monotonic()):
                logger.info("unloading idle model %s", entry.name)
                self._begin_unload(entry)

    # ---- the server's life ------------------------------------------------------------------------
    async def drain(self, timeout: float) -> int:
        """SIGTERM: new requests get 503; every loaded model's running requests get `timeout` seconds."""
        self.draining = True
        counts = await asyncio.gather(*(e.manager.drain(timeout) for e in list(self.engines.values())))
        return sum(counts)

    async def close(self) -> None:
        reaper = [self._reaper] if self._reaper is not None else []
        for task in [*reaper, *self._loads.values()]:
            task.cancel()
        await asyncio.gather(*reaper, *self._loads.values(), return_exceptions=True)
        await asyncio.gather(*self._unloads.values(), return_exceptions=True)
        engines, self.engines = list(self.engines.values()), {}
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)
        for entry in self.router.entries.values():
            entry.state = ModelState.UNLOADED
