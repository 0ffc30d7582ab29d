"""The engine's command-line flags (`--kv-cache-tokens`, `--precision`, tensor parallelism, speculative
decoding, ...) and their mapping onto `LLM` / `EngineConfig` keyword arguments: one module that the CLI's
commands and the bench commands both import."""

from __future__ import annotations

import argparse
import os

from tokenmill.config import (
    KV_CACHE_DTYPES,
    PRECISIONS,
    PROMPT_GEMMS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    EngineConfig,
    SpeculativeConfig,
)


def add_engine_args(parser: argparse.ArgumentParser, several_models: bool = False) -> None:
    """several_models: `--model` may repeat (`tokenmill serve`'s model router; args.model is then a list)."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    if several_models:
        g.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                       help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M); repeat it to serve "
                            "several models, each loaded on its first request, named NAME or after its file")
    else:
        g.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M)")
    g.add_argument("--kv-cache-tokens", type=int, default=d.kv_cache_tokens, help="KV pool size in tokens")
    g.add_argument("--kv-cache-memory-bytes", type=byte_size, default=None, metavar="N",
                   help="KV pool size in bytes instead (per rank; e.g. 2G or 500M, powers of 1024): as many "
                        "tokens as fit in --kv-cache-dtype's format, so int8 holds 1.88x the tokens of bf16; "
                        "replaces --kv-cache-tokens")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=d.kv_cache_dtype,
                   help="how K/V are stored: auto (bf16 in fast mode, fp32 in exact), bf16, fp32, or int8 "
                        "(a scale per token and head: 1.88x the tokens of bf16 in the same bytes; fast only)")
    g.add_argument("--page-size", type=int, default=d.page_size)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--precision", choices=["exact", "fast"], default=d.precision,
                   help="fast (default): a GGUF's quantized weights stay quantized, bf16 GEMMs on large "
                        "batches; exact: fp32 everywhere (token-identical to transformers)")
    g.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default=d.quantization,
                   help="fast only. auto: run the file's quantized weights as they are; none: dequantize "
                        "them; int8/int4: also quantize unquantized weights at load (e.g. safetensors)")
    g.add_argument("--prompt-gemm", choices=list(PROMPT_GEMMS), default=d.prompt_gemm,
                   help="fast only: how quantized weights run prompt steps. auto (default): Q4_1, Q4_K and "
                        "IQ4 dequantized to bf16 for oneDNN, the others on the int8 kernel that keeps their values; "
                        "vnni / bf16: one path for every format")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                   default=d.enable_prefix_caching, help="reuse cached KV of shared prompt prefixes (default: on)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="compute every prompt in full; nothing is cached")
    g.add_argument("--scheduling-policy", choices=list(SCHEDULING_POLICIES), default=d.scheduling_policy,
                   help="fcfs (default): arrival order; priority: a request's `priority` (lower first) picks "
                        "who is admitted first and who is preempted last")
    g.add_argument("--kv-cache-dir", default=d.kv_cache_dir, metavar="DIR",
                   help="the prefix cache's disk tier: cached KV pages are also written here and read back "
                        "instead of recomputed, also after a restart (default: none)")
    g.add_argument("--kv-cache-disk-bytes", type=byte_size, default=d.kv_cache_disk_bytes, metavar="N",
                   help="bound of --kv-cache-dir in bytes (e.g. 20G), least recently used pages out (default: 4 GiB)")
    g = parser.add_argument_group("tensor parallelism (torch.distributed; flags as torchrun's)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="split heads, MLP and vocabulary over this many ranks (must divide the heads, KV heads "
                        "and intermediate size)")
    g.add_argument("--nnodes", type=int, default=d.nnodes, help="machines the ranks are spread over")
    g.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="this machine's index; nodes other than 0 run their ranks and no server")
    g.add_argument("--master-addr", default=d.master_addr, help="where node 0's rank 0 listens")
    g.add_argument("--master-port", type=int, default=d.master_port, help="0: a free port (one node only)")
    s = SpeculativeConfig()
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--speculative-method", choices=list(SPECULATIVE_METHODS), default=None,
                   help="ngram: prompt lookup; draft: a smaller model (or the target itself in a cheaper form) "
                        "proposes; off by default")
    g.add_argument("--num-speculative-tokens", type=int, default=s.num_speculative_tokens)
    g.add_argument("--prompt-lookup-max", type=int, default=s.prompt_lookup_max)
    g.add_argument("--prompt-lookup-min", type=int, default=s.prompt_lookup_min)
    g.add_argument("--speculative-model", default=None, help="draft model (default: the target's own file)")
    g.add_argument("--speculative-draft-precision", choices=list(PRECISIONS), default=s.draft_precision)
    g.add_argument("--speculative-draft-quantization", choices=["auto", "none", "int8", "int4"],
                   default=s.draft_quantization)
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=s.disable_by_batch_size,
                   help="no speculation in steps with this many running requests")


def byte_size(text: str) -> int:
    """argparse's type for a size in bytes (8G, 512M, 1.5GiB or a number; powers of 1024, as
    `--max-memory` reads them: frontend/model_router.py `parse_memory`)."""
    from tokenmill.frontend.model_router import parse_memory

    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ("kv_cache_tokens", "kv_cache_memory_bytes", "kv_cache_dtype", "page_size", "max_num_batched_tokens",
            "max_num_seqs", "max_model_len", "precision", "quantization", "prompt_gemm", "num_threads", "seed",
            "enable_prefix_caching", "tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port",
            "scheduling_policy", "kv_cache_dir", "kv_cache_disk_bytes")
    kwargs = {k: getattr(args, k) for k in keys}
    if getattr(args, "speculative_method", None):
        model = args.speculative_model
        kwargs["speculative"] = SpeculativeConfig(
            method=args.speculative_method,
            num_speculative_tokens=args.num_speculative_tokens,
            prompt_lookup_max=args.prompt_lookup_max,
            prompt_lookup_min=args.prompt_lookup_min,
            model=os.path.abspath(os.path.expanduser(model)) if model else None,
            draft_precision=args.speculative_draft_precision,
            draft_quantization=args.speculative_draft_quantization,
            disable_by_batch_size=args.speculative_disable_by_batch_size,
        )
    return kwargs
