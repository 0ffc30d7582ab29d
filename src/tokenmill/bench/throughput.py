"""`tokenmill bench throughput`: the offline workload (all requests at once, ignore_eos, greedy) on
tokenmill and, optionally, on Hugging Face `generate` with the same weights, in one run.

Only generation is timed, never loading. Results are rates plus the fraction of this machine's matmul
ceiling, measured in the same process, because absolute times on a shared machine mean little.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from typing import Any

import torch

from tokenmill.bench.arg_types import at_least
from tokenmill.bench.common import (
    BenchRequest,
    RunResult,
    fast_gemm_dtype,
    format_table,
    make_workload,
    matmul_ceilings,
    model_flops,
    run_settings,
    summarize,
)
from tokenmill.entrypoints.engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)

PEERS = ("none", "transformers")
# Warm-up: a couple of short requests, enough to page in weights and let oneDNN pick its kernels
# for both prefill and decode shapes, short enough not to matter next to the timed run.
WARMUP_REQUESTS, WARMUP_PROMPT, WARMUP_OUTPUT = 2, (16, 32), (8, 8)


def add_throughput_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "throughput", help="offline throughput: N random-token requests at once, optionally against a peer"
    )
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=at_least(1), default=64)
    g.add_argument("--min-prompt", type=at_least(1), default=64)
    g.add_argument("--max-prompt", type=at_least(1), default=512)
    g.add_argument("--min-output", type=at_least(1), default=64)
    g.add_argument("--max-output", type=at_least(1), default=256)
    g.add_argument("--workload-seed", type=int, default=0)
    g = p.add_argument_group("benchmark")
    g.add_argument("--peer", choices=PEERS, default="none", help="also run this engine on the same workload")
    g.add_argument("--peer-batch-size", type=at_least(1), default=8, help="static batch size of the peer")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run a few short requests on each engine before timing (default: on)")
    g.add_argument("--repeats", type=at_least(1), default=1, help="timed runs per engine; median and spread reported")
    g.add_argument("--ceiling-size", type=at_least(1), default=2048, help="square matmul size for the ceilings")
    g.add_argument("--json", metavar="PATH", default=None, help="write settings and results here")
    g.add_argument("--report", metavar="DIR", default=None,
                   help="write an HTML report with plots (rates per engine, per-request latency CDFs) here")
    add_engine_args(p)
    p.set_defaults(func=cmd_throughput)


def cmd_throughput(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    if args.min_prompt > args.max_prompt or args.min_output > args.max_output:
        print("error: --min-prompt/--min-output must not exceed their --max-", file=sys.stderr)
        return 2
    kwargs = engine_kwargs(args)
    llm = LLM(args.model, **kwargs)
    threads = llm.config.threads
    # The architecture as tokenmill loaded it; the peer runs the same weights, so one FLOP count serves both.
    config = llm.engine.runner.model.config
    flops = model_flops(config)
    vocab = llm.engine.vocab_size
    workload = make_workload(args.requests, (args.min_prompt, args.max_prompt),
                             (args.min_output, args.max_output), vocab, args.workload_seed)
    settings = run_settings(threads)  # before the runs: the date and load they started under
    ceilings = matmul_ceilings(threads, args.ceiling_size)
    warmup = _warmup_workload(vocab, args.workload_seed) if args.warmup else None

    if warmup:
        run_tokenmill(llm, warmup)
    runs = []
    per_request: dict[str, list[float | None]] = {}  # the last repeat's, for the report's CDFs
    for _ in range(args.repeats):
        _reset_prefix_cache(llm)  # a repeat must not be served from the previous one's cache
        runs.append(run_tokenmill(llm, workload, per_request))
    results = {"tokenmill": summarize(runs, flops, ceilings[fast_gemm_dtype() if args.precision == "fast" else "fp32"])}
    results["tokenmill"]["per_request"] = per_request
    # Steps, preemptions and prefix-cache hits explain a number; they are cumulative over warm-up and repeats.
    engine_stats = llm.stats()
    del llm  # free its weights and KV pool before the peer loads its own copy
    gc.collect()

    if args.peer == "transformers":
        torch.set_num_threads(threads)
        model = load_transformers_peer(args.model)
        if warmup:
            run_transformers(model, warmup, args.peer_batch_size)
        runs = [run_transformers(model, workload, args.peer_batch_size) for _ in range(args.repeats)]
        results["transformers"] = summarize(runs, flops, ceilings["fp32"])  # the peer runs fp32
        del model
        gc.collect()

    report = {
        "settings": {**settings, "load_average_end": run_settings(threads)["load_average"],
                     "precision": args.precision, "engine_args": kwargs,
                     "args": {k: v for k, v in vars(args).items() if k != "func"}},
        "ceilings_gflop_per_s": ceilings,
        "model": {"source": args.model or "bundled SmolLM2-135M-Instruct (Q4_1 GGUF, run in fp32)",
                  "architecture": config.architecture, "body_params": flops.body_params,
                  "lm_head_params": flops.head_params, "attention_flops": "excluded"},
        "results": results,
        "tokenmill_engine_stats": engine_stats,
    }
    if "transformers" in results:
        report["ratio_output_tokens_per_s"] = (
            results["tokenmill"]["output_tokens_per_s"] / results["transformers"]["output_tokens_per_s"]
        )
    _print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.report:
        from tokenmill.bench.report import write_report

        print(f"report: {write_report(report, args.report, 'throughput')}")
    failed = any(r["errors"] for r in results.values())
    return 1 if failed else 0


def _warmup_workload(vocab: int, seed: int) -> list[BenchRequest]:
    # A different seed from the timed workload, so a prefix cache could not turn warm-up into a head start.
    return make_workload(WARMUP_REQUESTS, WARMUP_PROMPT, WARMUP_OUTPUT, vocab, seed + 1_000_003)


def _reset_prefix_cache(llm: Any) -> None:
    # The offline API may not expose it; the engine core does (EngineCore.reset_prefix_cache).
    for owner in (llm, getattr(llm, "engine", None)):
        reset = getattr(owner, "reset_prefix_cache", None)
        if callable(reset):
            reset()
            return


# ---- the engines -------------------------------------------------------------------------------
def run_tokenmill(llm: Any, workload: list[BenchRequest],
                  per_request: dict[str, list[float | None]] | None = None) -> RunResult:
    """One timed run; `per_request`, if given, receives each request's TTFT and mean inter-token
    latency (seconds, from RequestOutput.metrics, i.e. the engine's own clock)."""
    from tokenmill.sample.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)  # progress on stderr: a run takes a while
    seconds = time.perf_counter() - start
    errors, useful = [], 0
    for i, (req, out) in enumerate(zip(workload, outs)):
        got = len(out.outputs[0].token_ids)
        useful += min(got, req.output_len)
        if got != req.output_len:
            errors.append(f"tokenmill request {i}: {got} output tokens, asked for {req.output_len}")
    if per_request is not None:
        metrics = [out.metrics or {} for out in outs]
        per_request["ttft_s"] = [m.get("first_token_latency") for m in metrics]
        per_request["itl_s"] = [1.0 / m["decode_throughput"] if m.get("decode_throughput") else None for m in metrics]
    return RunResult(seconds, len(workload), _prompt_tokens(workload), useful, errors)


def load_transformers_peer(model_path: str | None) -> Any:
    """The same weights in transformers, fp32: a GGUF is dequantised by transformers itself."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from tokenmill.model.default_model import default_model_path

    hf_logging.set_verbosity_error()  # generation-config chatter and progress bars would bury the table
    hf_logging.disable_progress_bar()
    path = os.path.expanduser(model_path) if model_path else default_model_path()
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    return model.eval()


@torch.inference_mode()
def run_transformers(model: Any, workload: list[BenchRequest], batch_size: int) -> RunResult:
    """Static batches in submission order, left-padded, each run to its longest request's length.

    Only each request's own length counts as output: the rest of a batch's tokens are the waste a
    static batch really pays, which is the point of comparing against it.
    """
    from tqdm import tqdm

    pad = 0  # any id: the attention mask hides padding
    errors, useful = [], 0
    # Minutes without output otherwise: the bar (stderr) counts requests done, batch by batch.
    bar = tqdm(total=len(workload), desc="transformers", unit="req")
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first:first + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in batch)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=pad)
        got = out.shape[1] - width
        if got != new:
            errors.append(f"transformers batch at request {first}: {got} new tokens, asked for {new}")
        useful += sum(min(got, r.output_len) for r in batch)
        bar.update(len(batch))
    seconds = time.perf_counter() - start
    bar.close()
    return RunResult(seconds, len(workload), _prompt_tokens(workload), useful, errors)


def _prompt_tokens(workload: list[BenchRequest]) -> int:
    return sum(len(r.prompt_token_ids) for r in workload)


# ---- output ------------------------------------------------------------------------------------
def _print_report(report: dict) -> None:
    s, c = report["settings"], report["ceilings_gflop_per_s"]
    load = s["load_average"]
    wait = s["env"]["OMP_WAIT_POLICY"] or "default"
    print(f"threads {s['threads']} (OMP_WAIT_POLICY {wait}), precision {s['precision']}, load average "
          f"{'n/a' if load is None else f'{load[0]:.2f}'}; ceilings fp32 {c['fp32']:.0f} GFLOP/s, "
          f"bf16 {c['bf16']:.0f} GFLOP/s (tokenmill fast: bf16, exact and transformers: fp32)")
    if wait == "default" and s["threads"] > 1 and load is not None and load[0] > 1.0:
        print("note: other processes are running; with OpenMP's default spin-wait, several threads on shared "
              "cores can run many times slower: rerun with OMP_WAIT_POLICY=PASSIVE", file=sys.stderr)
    print(format_table(report["results"]))
    if "ratio_output_tokens_per_s" in report:
        print(f"tokenmill / transformers output tokens/s: {report['ratio_output_tokens_per_s']:.2f}x")
    print("FLOPs: layer matmuls on every computed position + lm_head on sampled ones; attention excluded.")
    st = report["tokenmill_engine_stats"]
    if st.get("spec_decode_num_drafts_total"):
        print(f"speculative decoding: {st['spec_decode_num_draft_tokens_total']} draft tokens, acceptance "
              f"{st['spec_decode_acceptance_rate']:.2f}, mean accepted length {st['spec_decode_mean_accepted_length']:.2f}")
    for name, r in report["results"].items():
        for error in r["errors"]:
            print(f"error ({name}): {error}", file=sys.stderr)
