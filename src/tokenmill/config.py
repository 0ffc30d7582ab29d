"""Engine settings: one frozen object, built from keyword arguments or CLI flags."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from tokenmill.errors import InvalidRequest, is_int
from tokenmill.model.quantization_modes import PROMPT_GEMMS, QUANTIZATIONS

PRECISIONS = ("exact", "fast")
# How K/V are stored in the page pool (model/kv_cache_format.py has the row formats).
KV_CACHE_DTYPES = ("auto", "bf16", "fp32", "int8")
SPECULATIVE_METHODS = ("ngram", "draft")
# How the data-parallel controller picks a replica (frontend/dp_controller.py).
LOAD_BALANCE_METHODS = ("round_robin", "least_requests", "least_tokens", "prefix_aware")
# Which waiting request is admitted first (engine/scheduling_policy.py).
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class DataParallelConfig:
    """`tokenmill serve --data-parallel-size N`: N scheduler processes, each a whole engine with its
    own KV pool, behind one HTTP front end (the offline LLM: N engine processes, llm_data_parallel.py)."""

    size: int = 1
    load_balance_method: str = "round_robin"

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise InvalidRequest(f"data_parallel_size must be an integer >= 1, got {self.size!r}",
                                 param="data_parallel_size")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise InvalidRequest(f"load_balance_method must be one of {LOAD_BALANCE_METHODS}, got "
                                 f"{self.load_balance_method!r}", param="load_balance_method")

    def replica_threads(self, threads: int) -> int:
        """Each replica's share of --num-threads (at least 1): replicas on one machine share its cores."""
        return max(1, threads // self.size)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec/): a proposer guesses the next tokens, the target verifies them.

    Greedy output is token-identical with and without it, and sampled output has the same
    distribution; only the speed changes.
    """

    method: str = "ngram"  # ngram: prompt lookup, no extra model; draft: a smaller model proposes
    # Tokens proposed per step. Measured on the bundled model, batch 1 (docs/benchmarks.md).
    num_speculative_tokens: int = 4
    # ngram: the longest suffix of prompt + output, from max down to min tokens, that occurred
    # before proposes the tokens that followed it (vLLM's prompt_lookup_max / _min).
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1  # a 1-token match proposes a single draft (engine/spec/ngram.py)
    # draft: the draft model (GGUF file or HF folder); None = the target's own file, run in the
    # draft's cheaper precision (no second checkpoint needed).
    model: str | None = None
    draft_precision: str = "fast"
    draft_quantization: str = "int4"
    # No speculation in a step where this many requests are running: with a full batch the extra
    # verification rows cost more than the accepted tokens save (vLLM's disable_by_batch_size).
    # Measured with ngram, k=4 (docs/benchmarks.md): on ordinary chat text 1.1-1.2x at 1 stream but
    # 0.8-0.9x at 4 and 8; on the editing workload still 1.2x at 8. 4 keeps the ordinary case safe.
    disable_by_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequest(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
                param="speculative_method",
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequest(f"{name} must be an integer >= 1, got {value!r}", param=name)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequest(
                f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max ({self.prompt_lookup_max})",
                param="prompt_lookup_min",
            )
        if self.draft_precision not in PRECISIONS:
            raise InvalidRequest(
                f"draft_precision must be one of {PRECISIONS}, got {self.draft_precision!r}", param="draft_precision"
            )
        if self.draft_quantization not in QUANTIZATIONS:
            raise InvalidRequest(
                f"draft_quantization must be one of {QUANTIZATIONS}, got {self.draft_quantization!r}",
                param="draft_quantization",
            )
        if self.draft_precision == "exact" and self.draft_quantization in ("int8", "int4"):
            raise InvalidRequest(
                f"draft_quantization {self.draft_quantization!r} needs draft_precision 'fast' (an exact draft "
                "computes its file's own weights in fp32: use draft_quantization 'auto')",
                param="draft_quantization",
            )

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """`LLM(speculative=...)` takes a config, a dict of its fields, or just a method name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            return cls(method=value)
        if not isinstance(value, dict):
            raise InvalidRequest(f"speculative must be a dict or a method name, got {value!r}", param="speculative")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequest(f"unknown speculative setting(s): {', '.join(unknown)}", param=unknown[0])
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # GGUF file or HF folder; None = the bundled SmolLM2-135M-Instruct
    # KV pool size in tokens. 65536 tokens of SmolLM2-135M are 1.4 GiB in bf16 (fast mode), 2.8 GiB
    # in fp32, 0.75 GiB in int8, but the pool is allocated lazily (torch.empty): only pages ever
    # written are resident.
    kv_cache_tokens: int = 65536
    # Or the pool's size in bytes (vLLM's --kv-cache-memory-bytes; per rank with tensor parallelism):
    # when set, the pool holds as many pages as fit in these bytes in kv_cache_dtype's format, so int8
    # K/V hold 1.88x the tokens of bf16, and it replaces kv_cache_tokens (the engine sets that to the
    # tokens the bytes hold, once the model's shape is known: engine/factory.py).
    kv_cache_memory_bytes: int | None = None
    # How K/V are stored (model/kv_cache_format.py): auto = bf16 in fast mode, fp32 in exact; int8 =
    # a scale per token and KV head, 1.88x the tokens of bf16 in the same bytes (fast mode only).
    kv_cache_dtype: str = "auto"
    # 16 tokens a page: small enough that a request wastes < 16 slots, and page-aligned prefix
    # sharing stays fine-grained; the gather cost in attention is per token, not per page.
    page_size: int = 16
    # Sliding-window layers (gemma2/gemma3) in KV groups of their own that keep only the window
    # (kvcache/kv_groups.py); False keeps every layer's K/V for the whole context (the comparison
    # `tokenmill bench kv-memory --full-kv` makes).
    hybrid_kv_cache: bool = True
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
    # fast only: how a GGUF's quantized weights run prompt steps (192+ rows). auto: by format, Q4_1,
    # Q4_K and IQ4 dequantized to bf16 for oneDNN's GEMM (~12% less CPU), the others (Q4_0, Q2/Q3_K,
    # Q5, Q6_K, Q8_0) on the two-term int8 kernel, which keeps their values (top-1 vs exact >= 99% on
    # every mix measured); vnni / bf16: one path for all (docs/benchmarks.md, "per-format prompt path").
    prompt_gemm: str = "auto"
    num_threads: int | None = None  # None: all cores
    seed: int = 0  # engine-level generator for unseeded requests
    # Radix-tree prefix cache: finished prompts' KV stays cached (evicted LRU when pages run short)
    # and later requests with the same page-aligned prefix skip computing it.
    enable_prefix_caching: bool = True
    # Speculative decoding (a SpeculativeConfig, its fields as a dict, or a method name); None: off.
    speculative: SpeculativeConfig | None = None
    # Tensor parallelism (parallel/): the model's heads, MLP and vocabulary split over this many
    # ranks; rank 0 runs the engine. Ranks on other machines join with nnodes / node_rank /
    # master_addr / master_port, as torchrun's flags (master_port 0: pick a free port, one node only).
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # fcfs: arrival order; priority: SamplingParams.priority (lower first), and under memory pressure
    # the lowest-priority running request is preempted first (engine/scheduling_policy.py).
    scheduling_policy: str = "fcfs"
    # The prefix cache's disk tier (engine/kv_offload.py): pages the tree takes are written through to
    # files under this folder (bounded by kv_cache_disk_bytes, least recently used out) and read back
    # on a later match instead of being recomputed, also after a restart. None: no disk tier.
    kv_cache_dir: str | None = None
    kv_cache_disk_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        positive = ("kv_cache_tokens", "page_size", "max_num_batched_tokens", "max_num_seqs", "bf16_min_rows")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{name} must be an integer >= 1, got {value!r}", param=name)
        if self.kv_cache_memory_bytes is not None and (
                not isinstance(self.kv_cache_memory_bytes, int) or isinstance(self.kv_cache_memory_bytes, bool)
                or self.kv_cache_memory_bytes < 1):
            raise InvalidRequest(f"kv_cache_memory_bytes must be an integer >= 1, got {self.kv_cache_memory_bytes!r}",
                                 param="kv_cache_memory_bytes")
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
        self._check_kv_cache_dtype()
        if self.prompt_gemm not in PROMPT_GEMMS:
            raise InvalidRequest(f"prompt_gemm must be one of {PROMPT_GEMMS}, got {self.prompt_gemm!r}",
                                 param="prompt_gemm")
        if not isinstance(self.kv_cache_disk_bytes, int) or self.kv_cache_disk_bytes < 1:
            raise InvalidRequest(f"kv_cache_disk_bytes must be an integer >= 1, got {self.kv_cache_disk_bytes!r}",
                                 param="kv_cache_disk_bytes")
        if self.num_threads is not None and (not is_int(self.num_threads) or self.num_threads < 1):
            raise InvalidRequest(f"num_threads must be an integer >= 1 (or left out: every core), got "
                                 f"{self.num_threads!r}", param="num_threads")
        if not is_int(self.seed):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}", param="seed")
        if self.kv_cache_dir is not None:
            if not isinstance(self.kv_cache_dir, str) or not self.kv_cache_dir:
                raise InvalidRequest("kv_cache_dir must be a folder's path", param="kv_cache_dir")
            _check_writable_folder(self.kv_cache_dir)
            if not self.enable_prefix_caching:
                raise InvalidRequest("kv_cache_dir extends the prefix cache, which is off (--no-prefix-caching)",
                                     param="kv_cache_dir")
            if self.tensor_parallel_size > 1:
                raise InvalidRequest("kv_cache_dir works on one rank only for now (each rank would need its "
                                     "own share of every page)", param="kv_cache_dir")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequest(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                                 f"{self.scheduling_policy!r}", param="scheduling_policy")
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidRequest("enable_prefix_caching must be true or false", param="enable_prefix_caching")
        # A dict (from JSON between processes, or LLM(speculative={...})) becomes the config here.
        object.__setattr__(self, "speculative", SpeculativeConfig.from_value(self.speculative))
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 1):
            raise InvalidRequest(f"max_model_len must be an integer >= 1, got {self.max_model_len!r}",
                                 param="max_model_len")
        self._check_tensor_parallel()

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequest(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
                                 param="kv_cache_dtype")
        if self.precision == "exact" and self.kv_cache_dtype == "int8":
            # exact promises transformers' fp32 numbers; int8 K/V change them by design.
            raise InvalidRequest("kv_cache_dtype 'int8' needs precision 'fast' (exact mode keeps K/V in fp32 or "
                                 "bf16: use --kv-cache-dtype fp32, bf16 or auto)", param="kv_cache_dtype")

    def _check_tensor_parallel(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequest(f"{name} must be an integer >= 1, got {value!r}", param=name)
        if self.tensor_parallel_size % self.nnodes:
            raise InvalidRequest(f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of nnodes "
                                 f"{self.nnodes} (each node runs the same number of ranks)", param="nnodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidRequest(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}", param="node_rank")
        if not 0 <= self.master_port <= 65535:
            raise InvalidRequest(f"master_port must be a TCP port, got {self.master_port}", param="master_port")
        if self.nnodes > 1 and self.master_port == 0:
            raise InvalidRequest("with nnodes > 1 every node must be given the same master_port", param="master_port")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

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


def _check_writable_folder(path: str) -> None:
    """kv_cache_dir: a folder that exists, or can be made, and can be written (checked before any process
    starts; the disk tier itself makes it)."""
    folder = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise InvalidRequest(f"kv_cache_dir {path} is not a folder", param="kv_cache_dir")
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise InvalidRequest(f"kv_cache_dir {path} cannot be written ({existing} is not a writable folder)",
                             param="kv_cache_dir")
