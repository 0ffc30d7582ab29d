"""Builds an engine core from an EngineConfig: the model (model/builder.py; across tensor-parallel ranks
with parallel/), its KV pool, the engine around it."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.kv_offload import PageIO, build_offload
from tokenmill.engine.memory_trim import keep_step_memory, malloc_trim
from tokenmill.errors import InvalidRequest
from tokenmill.model.builder import build_model
from tokenmill.model.pooling import declared_pooling

logger = logging.getLogger(__name__)


def build_engine_core(config: EngineConfig) -> EngineCore:
    start = time.monotonic()
    if config.tensor_parallel_size > 1:
        from tokenmill.parallel.launch import build_rank0, set_rank_threads  # torch.distributed: only with TP

        set_rank_threads(config)
        built, runner = build_rank0(config)
    else:
        torch.set_num_threads(config.threads)
        built = build_model(config.model, config.precision, config.quantization, config.bf16_min_rows,
                            config.max_model_len, config.num_pages, config.page_size, kv_cache_dtype=config.kv_cache_dtype,
                            hybrid_kv=config.hybrid_kv_cache, prompt_gemm=config.prompt_gemm,
                            kv_cache_memory_bytes=config.kv_cache_memory_bytes)
        runner = built.runner
    if config.kv_cache_memory_bytes is not None:
        # The bytes decided the pool: from here on (scheduler, draft model, stats) it is this many tokens.
        config = dataclasses.replace(config, kv_cache_tokens=built.runner.num_pages * config.page_size)
    # Converting a GGUF leaves each matrix's transient copies (gate/up stacked, re-blocked in chunks)
    # as freed heap that glibc keeps: ~530 MB on a 964 MB MoE file of 1,500 expert matrices
    # (docs/benchmarks.md, "Mixture of experts"). Give it back once, ~20 ms.
    malloc_trim()
    keep_step_memory()  # from here on, what a step frees stays for the next one (memory_trim.py)
    mc, model = built.config, built.runner.model
    pooling = declared_pooling(built.source) or "last"  # for embedding requests
    core = EngineCore(config, runner, mc.vocab_size, mc.eos_token_ids, built.max_model_len, pooling_type=pooling)
    if config.kv_cache_dir is not None:
        attach_disk_tier(core, config, runner)
    logger.info(
        "loaded %s (%s, %d layers) in %.1fs; KV pool %d pages x %d tokens, %s (%d bytes a token, %.1f MB at most); "
        "precision %s; %d threads",
        built.source, mc.architecture, mc.num_layers, time.monotonic() - start,
        config.num_pages, config.page_size, built.runner.kv_format.name, built.runner.kv_bytes_per_token,
        built.runner.kv_bytes_per_token * config.num_pages * config.page_size / 1e6, config.precision, config.threads,
    )
    for line in model.describe():
        logger.info("layers %s", line)
    logger.info("weights in memory: %.1f MB", model.weight_bytes() / 1e6)
    return core


def attach_disk_tier(core: EngineCore, config: EngineConfig, runner: PageIO) -> None:
    from tokenmill.model.default_model import default_model_path

    if core.scheduler.windows is not None:
        # The tier stores a page as every layer's rows; a hybrid page is one KV group's (not built).
        raise InvalidRequest("the KV disk tier (--kv-cache-dir) does not support hybrid KV caches yet "
                             "(models with sliding-window layers, such as gemma2/gemma3); run without it",
                             param="kv_cache_dir")
    folder = os.path.abspath(os.path.expanduser(config.kv_cache_dir or ""))
    settings = {"precision": config.precision, "quantization": config.quantization}
    offload = build_offload(folder, config.kv_cache_disk_bytes, runner, core.pool,
                            config.model or default_model_path(), settings)
    core.attach_disk_tier(offload)
    atexit.register(offload.tier.flush)  # a script that never calls shutdown() still leaves its pages
    logger.info("KV disk tier: %s (%d pages known, at most %.1f GB)", offload.tier.folder,
                offload.tier.stats.pages, config.kv_cache_disk_bytes / 1e9)
