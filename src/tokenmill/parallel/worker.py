"""A tensor-parallel rank other than 0: joins the group, builds its shard of the model and runs every
step rank 0 broadcasts, until rank 0 says stop or goes away.

Started by parallel/launch.py as `python -m tokenmill.parallel.worker --rank R --config JSON`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import threading
import time

from tokenmill.config import EngineConfig
from tokenmill.engine.memory_trim import keep_step_memory
from tokenmill.ipc.lifecycle import child_process_setup, parent_alive
from tokenmill.model.builder import build_model
from tokenmill.parallel.launch import rank_config, set_rank_threads
from tokenmill.parallel.process_group import Endpoint, TensorParallelGroup
from tokenmill.parallel.runner import serve_steps
from tokenmill.parallel.sharding import TensorParallelShard

logger = logging.getLogger(__name__)
PARENT_POLL_S = 0.5
# How long a SIGTERM waits to learn whether the engine process is dying (see _watch).
DEATH_GRACE_S = 2.0


def _watch(rank: int, wakeup: int) -> None:
    """Ends the process from outside the main thread, which sits inside a collective most of the time,
    where Python signal handlers don't run (the C-level one still writes the signal to `wakeup`)."""
    while True:
        signalled, _, _ = select.select([wakeup], [], [], PARENT_POLL_S)
        if signalled:
            os.read(wakeup, 64)
            # The engine's death signal comes when the thread that started this process dies, and its
            # other threads may still be exiting, our parent id still theirs: give it a moment to tell.
            deadline = time.monotonic() + DEATH_GRACE_S
            while parent_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
        if not parent_alive():
            # A real break: a normal end stops the ranks first (parallel/runner.py), so this warns only
            # when the engine process died (its death signal, PR_SET_PDEATHSIG, is the SIGTERM here).
            logger.warning("rank %d: the engine process died without stopping the group; exiting", rank)
            os._exit(1)
        if signalled:  # SIGTERM with the engine alive: asked to stop; nothing to flush
            os._exit(0)


def _watch_in_background(rank: int) -> None:
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the watcher acts on it
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(rank, read), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tokenmill tensor-parallel worker (started by the engine)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    child_process_setup(f"tp-rank{args.rank}", args.log_level, args.parent_pid)
    _watch_in_background(args.rank)
    config = EngineConfig.from_kwargs(**json.loads(args.config))
    set_rank_threads(config)
    group = TensorParallelGroup(args.rank, config.tensor_parallel_size,
                                Endpoint(config.master_addr, config.master_port))
    config = rank_config(config, group)
    built = build_model(config.model, config.precision, config.quantization, config.bf16_min_rows,
                        config.max_model_len, config.num_pages, config.page_size, TensorParallelShard(group),
                        kv_cache_dtype=config.kv_cache_dtype, hybrid_kv=config.hybrid_kv_cache,
                        prompt_gemm=config.prompt_gemm, kv_cache_memory_bytes=config.kv_cache_memory_bytes)
    keep_step_memory()  # what a step frees stays for the next one (engine/memory_trim.py)
    try:
        steps = serve_steps(built.runner, group)
    except RuntimeError as exc:  # rank 0 went away mid-collective (the engine process died)
        logger.warning("rank %d: the group broke (%s); exiting", args.rank, exc)
        return 1
    logger.info("rank %d stopped after %d steps", args.rank, steps)
    group.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
