"""Where the API server renders chat templates and tokenizes: a thread, or N worker processes.

`tokenizers` releases the GIL while it encodes, but not all of the time (building the Python list of
a 100k-token result, the template's Jinja rendering), so a huge prompt tokenized in a thread of the
API process still slows every stream that process serves. `--tokenizer-workers N` (SGLang's
`--tokenizer-worker-num`) moves that work into N processes, each with its own tokenizer and template
sent once (pickled: 0.5 s to load in a worker, against ~20 s to read it from a GGUF file again).
The serving code calls one function for both modes, `run_tokenizer(manager, fn, ...)`,
which runs `fn(tokenizer, ...)` in a thread (N = 0, the default) or in a worker; `fn` must then be a
module-level function (it is pickled by name).

Workers die with the server: closed on shutdown, and killed by the kernel if the server dies
(PR_SET_PDEATHSIG, armed for the thread that spawns them: the event loop's, which lives as long as
the process). A worker that dies mid-request fails that request with a 500 and the pool is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from tokenmill.frontend.request_error import RequestError
from tokenmill.frontend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
CLOSE_TIMEOUT_S = 5.0  # a worker busy with a huge prompt gets this long to finish before it is killed


def check_length_bound(tokenizer: Tokenizer, text: str, max_model_len: int, param: str) -> None:
    """Reject a text that is certainly too long before tokenizing it (issue 15: tokenizing megabytes
    only to reject them stalls the server). Same 400 as TokenizerManager.validate's length check."""
    at_least = tokenizer.min_token_count(text)
    if at_least >= max_model_len:
        raise RequestError(
            f"this model's context length is {max_model_len} tokens, but the prompt has at least {at_least} "
            f"tokens ({len(text)} characters), which leaves no room for output",
            400, param, "context_length_exceeded",
        )


async def run_tokenizer(manager: Any, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(tokenizer, *args, **kwargs) off the event loop: in the manager's worker pool if it has one
    (`tokenize_pool`, set by the server for --tokenizer-workers), else in a thread (also for test
    managers that have no pool)."""
    pool: TokenizePool | None = getattr(manager, "tokenize_pool", None)
    if pool is None:
        return await asyncio.to_thread(fn, manager.tokenizer, *args, **kwargs)
    return await pool.run(fn, *args, **kwargs)


class TokenizePool:
    """N spawned processes, each holding a copy of the model's Tokenizer. Use it on the event loop:
    requests wait until start() has run."""

    def __init__(self, workers: int, log_level: str = "WARNING") -> None:
        if workers < 1:
            raise ValueError(f"a tokenizer pool needs at least 1 worker, got {workers}")
        self.workers = workers
        self._log_level = log_level
        self._initargs: tuple = ()
        self._closed = False
        self._started = asyncio.Event()
        self._pool: ProcessPoolExecutor | None = None

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn, not fork: the API process has threads and a zmq context that a fork would copy half-alive.
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=self._initargs)

    async def start(self, tokenizer: Tokenizer) -> list[int]:
        """Spawn every worker now (this thread's death would kill them: call it on the event loop)
        and wait until each holds the tokenizer; their pids."""
        self._initargs = (tokenizer, self._log_level, os.getpid())
        self._pool = self._new_pool()
        self._started.set()
        # N calls at once make the executor spawn N processes (it spawns one per call while none is idle).
        pids = await asyncio.gather(*(self.run(_worker_pid, 0.5) for _ in range(self.workers)))
        logger.info("tokenizer workers ready: pids %s", sorted(set(pids)))
        return pids

    async def start_with(self, manager: Any) -> None:
        """start() once the manager has loaded the tokenizer (the first thing its start-up does)."""
        while manager.tokenizer is None:
            await asyncio.sleep(0.05)
        await self.start(manager.tokenizer)

    def pids(self) -> list[int]:
        # The executor keeps its processes private; the server needs them to be sure none outlives it.
        processes = self._pool._processes if self._pool is not None else None
        return [p.pid for p in (processes or {}).values() if p.pid is not None]

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        await self._started.wait()
        if self._closed:
            raise RequestError("the server is shutting down", 503, code="server_shutting_down")
        pool = self._pool
        assert pool is not None
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, _call, fn, args, kwargs)
        except BrokenProcessPool as exc:
            self._replace(pool)
            raise RequestError(
                "a tokenizer worker process died while preparing this request (the server restarted its workers); "
                "retry the request", 500, code="tokenizer_worker_died",
            ) from exc

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        if self._pool is not broken or self._closed:  # another request already replaced it
            return
        logger.error("a tokenizer worker died; starting a new pool of %d", self.workers)
        self._pool = self._new_pool()
        broken.shutdown(wait=False, cancel_futures=True)

    async def close(self) -> None:
        """Stop every worker: let a busy one finish for CLOSE_TIMEOUT_S, then kill it."""
        self._closed = True
        self._started.set()  # a request still waiting for start() gets its 503
        if self._pool is None:
            return
        procs = list((self._pool._processes or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(_join_or_kill, procs)


def _join_or_kill(procs: list[multiprocessing.Process]) -> None:
    for proc in procs:
        proc.join(CLOSE_TIMEOUT_S)
        if proc.is_alive():
            logger.warning("tokenizer worker %d did not stop; killing it", proc.pid)
            proc.kill()
            proc.join()


# ---- in the worker --------------------------------------------------------------------------------

_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer, log_level: str, parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        # SIGKILL, not SIGTERM: a worker holds nothing to clean up, and SIGTERM's SystemExit would be
        # caught by the executor's worker loop as a task's exception and leave the worker running.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the server died before the death signal was armed
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s tokenizer-worker[%(process)d] %(name)s: %(message)s")
    global _tokenizer
    _tokenizer = tokenizer
    with contextlib.suppress(Exception):  # compile the chat template now, not on the first request
        _tokenizer.render_chat([{"role": "user", "content": "hi"}])


def _call(fn: Callable[..., T], args: tuple, kwargs: dict[str, Any]) -> T:
    assert _tokenizer is not None, "the worker's initializer did not run"
    return fn(_tokenizer, *args, **kwargs)


def _worker_pid(tokenizer: Tokenizer, hold_s: float) -> int:
    import time

    time.sleep(hold_s)  # keep this worker busy so that the other start() calls spawn their own
    return os.getpid()
