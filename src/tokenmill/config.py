"""Engine settings: one frozen object, built from keyword arguments or CLI flags."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from tokenmill.errors import InvalidRequest
from tokenmill.model.layers.factory import QUANTIZATIONS

PRECISIONS = ("exact", "fast")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # GGUF file or HF folder; None = the bundled SmolLM2-135M-Instruct
    # KV pool size in tokens. 65536 tokens of SmolLM2-135M are 1.4 GiB in bf16 (fast mode), 2.8 GiB
    # in fp32, but the pool is allocated lazily (torch.empty): only pages ever written are resident.
    kv_cache_tokens: int = 65536
    # 16 tokens a page: small enough that a request wastes < 16 slots, and page-aligned prefix
    # sharing stays fine-grained; the gather cost in attention is per token, not per page.
    page_size: int = 16
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decode rows)
    max_num_seqs: int = 128  # running requests at most
    max_model_len: int | None = None  # None: the model's context length
    # exact: fp32 everywhere (token-identical to transformers). fast (default, what llama.cpp users
    # expect): a GGUF's Q4_0/Q4_1/Q8_0 weights stay quantized and run in the CPU kernel; dense weights
    # use bf16 GEMMs from `bf16_min_rows` rows (model/layers/).
    precision: str = "fast"
    # fast only. auto: keep the file's quantized weights as they are; none: dequantize them (dense
    # fast path); int8 / int4: also quantize dense weights at load (vLLM's --quantization).
    quantization: str = "auto"
    # Measured (2 threads, SmolLM2 shapes): bf16 GEMMs win from ~4 rows on (16 rows: 0.33 vs 0.55 ms
    # for gate_up); below that the layers are a wash, but the 49152-row lm_head is 3x faster in bf16
    # even for one row, so the lm_head ignores this threshold (model/llama.py).
    bf16_min_rows: int = 4
    num_threads: int | None = None  # None: all cores
    seed: int = 0  # engine-level generator for unseeded requests
    # Radix-tree prefix cache: finished prompts' KV stays cached (evicted LRU when pages run short)
    # and later requests with the same page-aligned prefix skip computing it.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        positive = ("kv_cache_tokens", "page_size", "max_num_batched_tokens", "max_num_seqs", "bf16_min_rows")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{name} must be an integer >= 1, got {value!r}", param=name)
        if self.kv_cache_tokens < self.page_size:
            raise InvalidRequest("kv_cache_tokens must hold at least one page", param="kv_cache_tokens")
        if self.precision not in PRECISIONS:
            raise InvalidRequest(f"precision must be one of {PRECISIONS}, got {self.precision!r}", param="precision")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequest(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}", param="quantization"
            )
        if self.precision == "exact" and self.quantization in ("int8", "int4"):
            raise InvalidRequest(
                f"quantization {self.quantization!r} needs precision 'fast' (exact computes the file's own "
                "weights in fp32)", param="quantization",
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidRequest("enable_prefix_caching must be true or false", param="enable_prefix_caching")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequest("max_model_len must be >= 1", param="max_model_len")

    @property
    def num_pages(self) -> int:
        return self.kv_cache_tokens // self.page_size

    @property
    def threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequest(f"unknown engine argument(s): {', '.join(unknown)}", param=unknown[0])
        return cls(**kwargs)
