"""A tensor-parallel rank other than 0: joins the group, builds its shard of the model and runs every
step rank 0 broadcasts, until rank 0 says stop or goes away.

Started by parallel/launch.py as `python -m tokenmill.parallel.worker --rank R --config JSON`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time

from tokenmill.config import EngineConfig
from tokenmill.ipc.lifecycle import child_process_setup, parent_alive
from tokenmill.model.builder import build_model
from tokenmill.parallel.launch import rank_config, set_rank_threads
from tokenmill.parallel.process_group import Endpoint, TensorParallelGroup
from tokenmill.parallel.runner import serve_steps
from tokenmill.parallel.sharding import TensorParallelShard

logger = logging.getLogger(__name__)
PARENT_POLL_S = 0.5


def _exit_with_parent() -> None:
    # The main thread sits inside a collective most of the time, where Python signal handlers don't
    # run; this thread notices the parent's death and ends the process from outside.
    while parent_alive():
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tokenmill tensor-parallel worker (started by the engine)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    child_process_setup(f"tp-rank{args.rank}", args.log_level, args.parent_pid)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing to flush: end at once, even mid-collective
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    config = EngineConfig.from_kwargs(**json.loads(args.config))
    set_rank_threads(config)
    group = TensorParallelGroup(args.rank, config.tensor_parallel_size,
                                Endpoint(config.master_addr, config.master_port))
    config = rank_config(config, group)
    built = build_model(config.model, config.precision, config.quantization, config.bf16_min_rows,
                        config.max_model_len, config.num_pages, config.page_size, TensorParallelShard(group, kv_cache_dtype=config.kv_cache_dtype))
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
