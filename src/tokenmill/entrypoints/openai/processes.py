"""Start, watch and stop the server's child processes (scheduler, detokenizer; one pair per
data-parallel replica, each pair in its own IPC directory and named `scheduler-i` / `detokenizer-i`).

Children are plain `python -m` subprocesses, not multiprocessing: their command line says what they
are, their arguments are JSON (nothing pickled), and no resource-tracker process tags along.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

from tokenmill.config import DataParallelConfig, EngineConfig
from tokenmill.ipc.channels import IpcPaths
from tokenmill.model.tokenizer_export import handoff_path

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
TERMINATE_TIMEOUT_S = 10.0


class ChildProcesses:
    def __init__(self, paths: IpcPaths, config: EngineConfig, served_model_name: str | None, log_level: str,
                 data_parallel: DataParallelConfig | None = None) -> None:
        self.paths = paths
        self.config = config
        self.data_parallel = data_parallel or DataParallelConfig()
        self.served_model_name = served_model_name
        self.log_level = log_level
        self.procs: dict[str, subprocess.Popen] = {}
        self.niceness = 0  # > 0: started under `nice -n` (a model loading beside others: model_pool.py)
        self._reported: set[str] = set()

    def commands(self) -> list[tuple[str, list[str]]]:
        """(name, command line) of every child: one scheduler + detokenizer pair per replica."""
        dp = self.data_parallel
        if dp.size == 1:
            return self._pair(self.paths, self.config, None)
        # Replicas share the machine's cores: each gets its share of the threads, so N engines never
        # oversubscribe what one engine would have used.
        config = dataclasses.replace(self.config, num_threads=dp.replica_threads(self.config.threads))
        return [cmd for i in range(dp.size) for cmd in self._pair(self.paths.replica(i), config, i)]

    def start(self) -> None:
        commands = self.commands()
        env = dict(os.environ)
        # OpenMP threads wait between parallel regions; how long they spin before sleeping decides
        # both the idle and the shared case. Spinning forever (libgomp's default) steals the core a
        # descheduled partner needs when another process is busy; never spinning (PASSIVE) pays a
        # futex wake-up per region, ~150 a decode step. A short spin (~1000 iterations, a few µs)
        # covers the gaps inside a step and sleeps between steps, i.e. spins only while the engine
        # has work. Measured, batch-1 decode step, 2 threads (docs/benchmarks.md): idle machine
        # 6.7 ms (PASSIVE 13.2, default 8.1); one competing busy process 19.2 ms (PASSIVE 12.1,
        # default 25.2, spin 20000: 113).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.setdefault("GOMP_SPINCOUNT", "1000")
        # oneDNN keeps a primitive per GEMM shape it has seen (up to 1024), and steps of 192+ rows run
        # bf16 GEMMs whose row count changes every step: under a 64-stream soak the scheduler's memory
        # outside the KV pool crept up ~25 MB over 10 minutes. Eight entries hold one step's shapes;
        # re-creating them cost nothing measurable (docs/benchmarks.md, "Memory under load").
        env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8")
        nice = shutil.which("nice") if self.niceness else None
        for name, cmd in commands:
            self.procs[name] = subprocess.Popen([nice, "-n", str(self.niceness), *cmd] if nice else cmd, env=env)
            logger.info("started the %s process (pid %d)", name, self.procs[name].pid)

    def _pair(self, paths: IpcPaths, config: EngineConfig, replica: int | None) -> list[tuple[str, list[str]]]:
        """The scheduler and detokenizer commands of one engine (replica None: the only one)."""
        common = ["--ipc-dir", paths.directory, "--log-level", self.log_level, "--parent-pid", str(os.getpid())]
        scheduler = [sys.executable, "-m", "tokenmill.engine.scheduler_process", *common,
                     "--config", json.dumps(dataclasses.asdict(config))]
        if self.served_model_name:
            scheduler += ["--served-model-name", self.served_model_name]
        # The API process exports the tokenizer for every detokenizer (model/tokenizer_export.py).
        detokenizer = [sys.executable, "-m", "tokenmill.frontend.detokenizer_process", *common,
                       "--tokenizer-file", handoff_path(self.paths.directory)]
        if config.model:
            detokenizer += ["--model", config.model]
        if replica is None:
            return [("scheduler", scheduler), ("detokenizer", detokenizer)]
        return [(f"scheduler-{replica}", [*scheduler, "--replica", str(replica)]),
                (f"detokenizer-{replica}", detokenizer)]

    async def watch(self, on_exit: Callable[[str, int], None]) -> None:
        """Calls on_exit(name, returncode) once for each child that exits."""
        while True:
            for name, proc in self.procs.items():
                code = proc.poll()
                if code is not None and name not in self._reported:
                    self._reported.add(name)
                    on_exit(name, code)
            await asyncio.sleep(WATCH_INTERVAL_S)

    def terminate(self) -> None:
        """SIGTERM every child, wait, SIGKILL what is left: nothing survives the server."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for name, proc in self.procs.items():
            try:
                proc.wait(TERMINATE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the %s process (pid %d) ignored SIGTERM; killing it", name, proc.pid)
                proc.kill()
                proc.wait()
