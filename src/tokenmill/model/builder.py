"""Builds a runnable model from a checkpoint: load weights, lay them out for the precision, construct
the model and its runner with the KV pool tensors.

The target model, a speculative draft model and every tensor-parallel rank are built here. Tensor
parallelism changes three things, given as a `ModelShard` (parallel/sharding.py implements it):
the per-rank hyper-parameters, the rank's slice of each weight, and the wrapping of the layers whose
outputs must be summed or gathered across ranks. Nothing in model/ knows about process groups.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from tokenmill.errors import InvalidRequest
from tokenmill.kvcache.kv_groups import KVLayout
from tokenmill.model.config import ModelConfig
from tokenmill.model.huge_pages import move_to_huge_pages
from tokenmill.model.kernels import cpu_isa
from tokenmill.model.kv_cache_format import KVCacheFormat
from tokenmill.model.layers.factory import LayerPolicy, describe_fallbacks
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_weights
from tokenmill.model.registry import model_class
from tokenmill.model.runner import ModelRunner

logger = logging.getLogger(__name__)


class ModelShard(Protocol):
    """One rank's part of a tensor-parallel model."""

    rank: int
    size: int

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The hyper-parameters this rank's layers have (heads and intermediate size divided)."""

    def shard_weights(self, config: ModelConfig, weights: dict) -> dict:
        """This rank's slice of every weight (quantized weights sliced before any repacking)."""

    def parallelize(self, model: LlamaForCausalLM) -> None:
        """Wraps the layers whose partial results are combined across ranks."""


@dataclass
class BuiltModel:
    runner: ModelRunner  # the model with its own KV pool tensors
    config: ModelConfig  # the whole model's hyper-parameters (a shard's own are on runner.model)
    max_model_len: int
    source: str  # where the weights came from, for logs


def build_model(
    path: str | None, precision: str, quantization: str, bf16_min_rows: int, max_model_len: int | None,
    num_pages: int, page_size: int, shard: ModelShard | None = None, kv_cache_dtype: str = "auto",
    hybrid_kv: bool = True, prompt_gemm: str = "auto", kv_cache_memory_bytes: int | None = None,
) -> BuiltModel:
    """Weights loaded, laid out for `precision` / `quantization`, and a runner with its KV tensors
    in `kv_cache_dtype`'s format (model/kv_cache_format.py). `hybrid_kv`: sliding-window layers get
    KV groups of their own (kvcache/kv_groups.py); False keeps every layer's KV for the whole context.
    `prompt_gemm`: how quantized weights run prompt steps (EngineConfig.prompt_gemm).
    `kv_cache_memory_bytes`: when given, the pool holds the pages that fit in these bytes (in the
    format, this rank's heads, the layout) instead of `num_pages`; runner.num_pages says how many."""
    cpu_isa.cap()  # a TOKENMILL_CPU_ISA it does not know fails here, naming it
    loaded = load_weights(path)
    source = loaded.source
    mc = loaded.config
    max_len = min(max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    if max_model_len is not None and max_model_len > mc.max_position_embeddings:
        # Positions past what the model was trained on give garbage: served at the model's own length.
        logger.warning("max_model_len %d is more than the model's context length %d: using %d",
                       max_model_len, mc.max_position_embeddings, max_len)
    policy = LayerPolicy(precision, quantization, bf16_min_rows, prompt_gemm)
    weights, layer_config = loaded.weights, mc
    if shard is not None:
        weights, layer_config = shard.shard_weights(mc, weights), shard.shard_config(mc)
    model = model_class(mc.architecture)(layer_config, weights, max_len, policy=policy)
    del weights, loaded  # the file's pages and any block copies go with them
    # One line for the model: every rank falls back alike, rank 0 says so (with its own shards' bytes).
    if (shard is None or shard.rank == 0) and (line := describe_fallbacks(
            policy.fallbacks, shard.size if shard is not None else 1)) is not None:
        logger.warning("%s", line)
    if shard is not None:
        shard.parallelize(model)
    move_to_huge_pages(model)  # the weights on 2 MB pages where Linux has them (huge_pages.py)
    kv_format = KVCacheFormat.resolve(kv_cache_dtype, precision)
    # Fast mode attends prompts through the paged kernel too; exact keeps SDPA (transformers' numbers).
    as_rows = precision == "fast" and getattr(model, "prompts_as_decode_rows", True)
    layout = kv_layout_for(mc) if hybrid_kv else None
    if kv_cache_memory_bytes is not None:
        num_pages = pages_in_bytes(kv_cache_memory_bytes, ModelRunner.token_bytes(model, kv_format, layout),
                                   page_size, kv_format.name)
    runner = ModelRunner(model, num_pages, page_size, kv_format, prefill_as_decode_rows=as_rows, kv_layout=layout)
    return BuiltModel(runner, mc, max_len, source)


def pages_in_bytes(nbytes: int, token_bytes: int, page_size: int, format_name: str) -> int:
    """Whole pages of `page_size` tokens at `token_bytes` each that fit in `nbytes`; InvalidRequest
    naming the sizes when not even one does."""
    page_bytes = token_bytes * page_size
    if nbytes < page_bytes:
        raise InvalidRequest(f"kv_cache_memory_bytes {nbytes} holds no KV page: one page of {page_size} tokens "
                             f"takes {page_bytes} bytes in {format_name} for this model", param="kv_cache_memory_bytes")
    return nbytes // page_bytes


def kv_layout_for(config: ModelConfig) -> KVLayout:
    """KV groups by attention type: sliding-window layers apart from full ones (one group for
    models without sliding layers)."""
    return KVLayout.for_layers([config.sliding_window if config.is_sliding(i) else None
                                for i in range(config.num_layers)])
