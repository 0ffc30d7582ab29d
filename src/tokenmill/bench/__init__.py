"""`tokenmill bench ...`: the benchmark commands, their shared workload / report code and the peers
(llama.cpp's tools, transformers) they are measured against.

The CLI registers the commands from `COMMANDS` (each module builds its own sub-parser), so the CLI
knows no benchmark and no benchmark imports the CLI; engine flags come from `entrypoints.engine_args`.
"""

from __future__ import annotations

import argparse
from importlib import import_module

# (module under tokenmill.bench, its function that adds the sub-parser), in `tokenmill bench -h` order
COMMANDS: tuple[tuple[str, str], ...] = (
    ("throughput", "add_throughput_parser"),
    ("latency", "add_latency_parser"),
    ("spec", "add_spec_parser"),
    ("serve", "add_serve_parser"),
    ("quality", "add_quality_parser"),
    ("fidelity", "add_fidelity_parser"),
    ("kv_cache", "add_kv_cache_parser"),
    ("gguf_mixes", "add_mixes_parser"),
    ("soak", "add_soak_parser"),
    ("tokenizer_stall", "add_tokenizer_stall_parser"),
    ("model_switch", "add_model_switch_parser"),
    ("disk_tier", "add_disk_tier_parser"),
    ("kv_memory", "add_kv_memory_parser"),
    ("load_memory", "add_load_memory_parser"),
    ("make_moe", "add_make_moe_parser"),
    ("make_low_bit", "add_make_low_bit_parser"),
    ("decode_step", "add_decode_step_parser"),
    ("moe_decode", "add_moe_decode_parser"),
    ("report", "add_report_parser"),
)


def add_bench_parsers(subparsers: argparse._SubParsersAction) -> None:
    for module, function in COMMANDS:
        getattr(import_module(f"tokenmill.bench.{module}"), function)(subparsers)
