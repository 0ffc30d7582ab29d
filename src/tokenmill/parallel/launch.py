"""Starting the tensor-parallel ranks: rank 0 inside the engine's process, the others as worker
processes (`python -m tokenmill.parallel.worker`), this node's started by this node.

Node 0 runs ranks 0 .. k-1 (k = ranks per node) and the engine; node i runs ranks i*k .. i*k+k-1
as workers only (`tokenmill serve --node-rank i`). Ranks meet at master_addr:master_port.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys

import torch

from tokenmill.config import EngineConfig
from tokenmill.model.builder import BuiltModel, build_model
from tokenmill.model.loader import read_model_config
from tokenmill.parallel.process_group import Endpoint, TensorParallelGroup
from tokenmill.parallel.runner import TensorParallelRunner
from tokenmill.parallel.sharding import TensorParallelShard, check_tensor_parallel_size

logger = logging.getLogger(__name__)


def rank_threads(config: EngineConfig) -> int:
    """Each rank's share of the node's threads (ranks on one node share its cores)."""
    return max(1, config.threads // config.ranks_per_node)


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def start_workers(config: EngineConfig, ranks: range, log_level: str) -> list[subprocess.Popen]:
    """Worker processes for `ranks` on this node; they exit when this process does."""
    args = json.dumps(dataclasses.asdict(config))
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("GOMP_SPINCOUNT", "1000")
    procs = []
    for rank in ranks:
        cmd = [sys.executable, "-m", "tokenmill.parallel.worker", "--rank", str(rank), "--config", args,
               "--log-level", log_level, "--parent-pid", str(os.getpid())]
        procs.append(subprocess.Popen(cmd, env=env))
        logger.info("started tensor-parallel rank %d (pid %d)", rank, procs[-1].pid)
    return procs


def build_rank0(config: EngineConfig) -> tuple[BuiltModel, TensorParallelRunner]:
    """The engine's side: starts this node's other ranks, joins the group as rank 0, builds its shard."""
    if config.node_rank != 0:
        raise ValueError("only node 0 runs the engine; other nodes run workers (run_node_workers)")
    # Refused before any rank starts: a size that doesn't divide the model fails in a second.
    check_tensor_parallel_size(read_model_config(config.model), config.tensor_parallel_size)
    if config.master_port == 0:
        config = dataclasses.replace(config, master_port=_free_port(config.master_addr))
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    workers = start_workers(config, range(1, config.ranks_per_node), str(log_level))
    try:
        group = TensorParallelGroup(0, config.tensor_parallel_size, Endpoint(config.master_addr, config.master_port))
        group.broadcast_bytes(json.dumps(dataclasses.asdict(config)).encode())  # see rank_config
        built = build_model(config.model, config.precision, config.quantization, config.bf16_min_rows,
                            config.max_model_len, config.num_pages, config.page_size, TensorParallelShard(group),
                            kv_cache_dtype=config.kv_cache_dtype, hybrid_kv=config.hybrid_kv_cache,
                            prompt_gemm=config.prompt_gemm, kv_cache_memory_bytes=config.kv_cache_memory_bytes)
    except BaseException:
        for proc in workers:
            proc.kill()
        raise
    return built, TensorParallelRunner(built.runner, group, workers)


def rank_config(local: EngineConfig, group: TensorParallelGroup) -> EngineConfig:
    """A rank > 0 takes rank 0's settings (pool size, precision, ...: every rank must lay out the same
    pages and the same layers), keeping its own model path and thread count, which are per machine."""
    remote = json.loads(group.broadcast_bytes(b""))
    return dataclasses.replace(EngineConfig.from_kwargs(**remote), model=local.model, num_threads=local.num_threads)


def run_node_workers(config: EngineConfig, log_level: str) -> int:
    """A node other than 0: runs its ranks until they exit; the exit code of the first that fails."""
    k = config.ranks_per_node
    procs = start_workers(config, range(config.node_rank * k, (config.node_rank + 1) * k), log_level)
    codes = [proc.wait() for proc in procs]
    return next((c for c in codes if c), 0)


def set_rank_threads(config: EngineConfig) -> None:
    torch.set_num_threads(rank_threads(config))
