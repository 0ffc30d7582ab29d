"""`tokenmill bench latency`: one user's speed, prompt processing and batch-1 decode tokens/s, on
tokenmill and, with `--peer llama.cpp`, on llama-bench with the same GGUF and threads, in one run.

The two tests mirror llama-bench's so the ratios compare like with like: pp<N> is one request of N
random ordinary tokens, timed to its first token (max_tokens=1, nothing served from the prefix cache);
tg<N> is N greedy tokens after a short prompt, timed from the first generated token to the last, so
only decode steps count. tokenmill runs first and is freed before llama-bench starts: the two never
share the cores. With `--rounds N` the two take turns N times and the ratio is the median of the
rounds' ratios: on a host whose speed drifts from minute to minute (a shared VM), one engine's whole
run can land in a slow stretch the other missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

from tokenmill.bench.arg_types import at_least
from tokenmill.bench.common import (
    fast_gemm_dtype,
    make_workload,
    matmul_ceilings,
    model_flops,
    run_settings,
)
from tokenmill.bench.llama_cpp_peer import PeerError, find_binary, run_llama_bench
from tokenmill.bench.token_bytes import read_ceiling, token_weight_bytes
from tokenmill.entrypoints.engine_args import add_engine_args, engine_kwargs

PEERS = ("none", "llama.cpp")
# llama-bench's tg starts from an empty context; a few tokens of prompt is the closest a request gets.
DECODE_PROMPT_LEN = 8
# Seeds of the warm-up and decode prompts: with the pp prompts' seeds they would start with the same
# tokens, and the prefix cache could serve one from another.
WARMUP_SEED_OFFSET, DECODE_SEED_OFFSET = 1_000_003, 500_009


def add_latency_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "latency", help="batch-1 decode and prompt-processing tok/s, optionally against llama-bench"
    )
    g = p.add_argument_group("workload")
    g.add_argument("--prompt-len", type=at_least(1), default=512, help="prompt tokens of the pp test (llama-bench pp512)")
    g.add_argument("--gen-len", type=at_least(2), default=128,  # decode speed is timed first token to last
                   help="tokens of the decode test (llama-bench tg128)")
    g.add_argument("--workload-seed", type=int, default=0)
    g = p.add_argument_group("benchmark")
    g.add_argument("--peer", choices=PEERS, default="none", help="also run this engine on the same GGUF and threads")
    g.add_argument("--llama-cpp", metavar="DIR", default=None,
                   help="folder of llama-bench (or a llama.cpp checkout with build/bin); default: "
                        "~/.cache/tokenmill-peers/llama.cpp-*/build/bin")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run each test once untimed before timing (default: on)")
    g.add_argument("--repeats", type=at_least(1), default=3, help="timed runs per test; median and spread reported")
    g.add_argument("--rounds", type=at_least(1), default=1,
                   help="with --peer: the two engines take turns this many times; the ratio is the rounds' median")
    g.add_argument("--ceiling-size", type=at_least(1), default=2048, help="square matmul size for the ceilings")
    g.add_argument("--json", metavar="PATH", default=None, help="write settings and results here")
    add_engine_args(p)
    p.set_defaults(func=cmd_latency)


def cmd_latency(args: argparse.Namespace) -> int:
    from tokenmill.model.default_model import default_model_path
    from tokenmill.model.preflight import check_model_path

    model_path = os.path.abspath(os.path.expanduser(args.model)) if args.model else default_model_path()
    check_model_path(model_path)  # the bytes line below reads the file before any engine loads it
    llama_bench = None
    if args.peer == "llama.cpp":
        # Both checks before loading anything: a missing peer should cost seconds, not a model load.
        if not (os.path.isfile(model_path) and model_path.endswith(".gguf")):
            raise PeerError(f"--peer llama.cpp needs a GGUF file (llama.cpp reads nothing else), got {model_path}")
        llama_bench = find_binary("llama-bench", args.llama_cpp)

    kwargs = engine_kwargs(args)
    first: dict[str, Any] = {"token_bytes": token_weight_bytes(model_path)}
    rounds: list[dict[str, dict]] = []
    for _ in range(args.rounds):
        results = {"tokenmill": _tokenmill_round(args, kwargs, first)}
        if llama_bench is not None:
            results["llama.cpp"] = _peer_round(llama_bench, model_path, args, first["threads"])
        rounds.append(results)
    results = rounds[0] if len(rounds) == 1 else _merged(rounds)
    config, settings, ceilings, pp_gflop = first["config"], first["settings"], first["ceilings"], first["pp_gflop"]
    threads = first["threads"]
    for engine, r in results.items():  # the prompt's work a second, and tokenmill's share of the ceiling
        r["pp"]["gflop_per_s"] = pp_gflop * r["pp"]["tokens_per_s"] / args.prompt_len
        if engine == "tokenmill":
            r["pp"]["fraction_of_ceiling"] = r["pp"]["gflop_per_s"] / ceilings[
                fast_gemm_dtype() if args.precision == "fast" else "fp32"]
        if first["token_bytes"]:  # decode against the bytes a token reads (bench/token_bytes.py)
            r["tg"]["gb_per_s"] = first["token_bytes"] * r["tg"]["tokens_per_s"] / 1e9
            r["tg"]["fraction_of_read_ceiling"] = r["tg"]["gb_per_s"] / first["read_ceiling"]

    report = {
        "settings": {**settings, "load_average_end": run_settings(threads)["load_average"],
                     "precision": args.precision, "engine_args": kwargs, "decode_prompt_len": DECODE_PROMPT_LEN,
                     "args": {k: v for k, v in vars(args).items() if k != "func"}},
        "ceilings_gflop_per_s": ceilings,
        "read_ceiling_gb_per_s": first["read_ceiling"],
        "model": {"path": model_path, "architecture": config.architecture, "pp_gflop": pp_gflop,
                  "token_weight_bytes": first["token_bytes"]},
        "results": results,
    }
    if "llama.cpp" in results:
        per_round = [{test: r["tokenmill"][test]["tokens_per_s"] / r["llama.cpp"][test]["tokens_per_s"]
                      for test in ("pp", "tg")} for r in rounds]
        report["ratios"] = {test: statistics.median(r[test] for r in per_round) for test in ("pp", "tg")}
        if len(rounds) > 1:
            report["round_ratios"] = per_round
    _print_report(report, args.prompt_len, args.gen_len)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if any(r["errors"] for r in results.values()) else 0


def _tokenmill_round(args: argparse.Namespace, kwargs: dict, first: dict[str, Any]) -> dict:
    """One round of tokenmill's tests, its engine freed after. The first round also records in `first`
    the model's config, its prompt's GFLOP, the threads, the run's settings and the matmul ceilings."""
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(args.model, **kwargs)
    if "threads" not in first:
        threads = llm.config.threads
        config = llm.engine.runner.model.config
        first.update(threads=threads, config=config, settings=run_settings(threads),  # the load they started under
                     pp_gflop=model_flops(config).run_flops(args.prompt_len, 1, 1) / 1e9)  # layers per token, lm_head once
        first["ceilings"] = matmul_ceilings(threads, args.ceiling_size)
        first["read_ceiling"] = read_ceiling(threads, first["token_bytes"]) if first["token_bytes"] else None
    vocab = llm.engine.vocab_size
    if args.warmup:
        measure_prompt(llm, _prompt(args.prompt_len, vocab, args.workload_seed + WARMUP_SEED_OFFSET))
        decode_seed = args.workload_seed + WARMUP_SEED_OFFSET + DECODE_SEED_OFFSET
        measure_decode(llm, _prompt(DECODE_PROMPT_LEN, vocab, decode_seed), min(args.gen_len, 8))
    pp_secs, tg_secs, errors = [], [], []
    for i in range(args.repeats):
        llm.reset_prefix_cache()  # fresh random prompts already miss; this makes sure
        pp_secs.append(measure_prompt(llm, _prompt(args.prompt_len, vocab, args.workload_seed + i)))
        decode_prompt = _prompt(DECODE_PROMPT_LEN, vocab, args.workload_seed + DECODE_SEED_OFFSET + i)
        seconds, got = measure_decode(llm, decode_prompt, args.gen_len)
        if got != args.gen_len:
            errors.append(f"tokenmill decode run {i}: {got} tokens, asked for {args.gen_len}")
        tg_secs.append(seconds)
    del llm  # free its weights and KV pool before the peer loads its own copy
    gc.collect()
    return {"pp": _rates([args.prompt_len / s for s in pp_secs]), "tg": _rates([(args.gen_len - 1) / s for s in tg_secs]),
            "errors": errors}


def _peer_round(llama_bench: str, model_path: str, args: argparse.Namespace, threads: int) -> dict:
    """One round of llama-bench's pp and tg tests on the same file and threads."""
    pp_test, tg_test, raw = run_llama_bench(llama_bench, model_path, args.prompt_len, args.gen_len, threads,
                                            args.repeats)
    return {
        "pp": {**_rates(pp_test.samples_ts or [pp_test.avg_ts]), "avg_ts": pp_test.avg_ts, "stddev_ts": pp_test.stddev_ts},
        "tg": {**_rates(tg_test.samples_ts or [tg_test.avg_ts]), "avg_ts": tg_test.avg_ts, "stddev_ts": tg_test.stddev_ts},
        "binary": llama_bench, "build_commit": pp_test.build_commit, "threads": pp_test.n_threads,
        "model_type": pp_test.model_type, "raw": raw, "errors": [],
    }


def _merged(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Each engine's tests over all rounds: every run's rate in one median and spread, the errors of all
    rounds, the first round's other fields."""
    merged: dict[str, dict] = {}
    for engine, first in rounds[0].items():
        entry = dict(first, errors=[e for r in rounds for e in r[engine]["errors"]])
        for test in ("pp", "tg"):  # llama-bench's own average and deviation are one round's: dropped
            entry[test] = _rates([rate for r in rounds for rate in r[engine][test]["runs"]])
        merged[engine] = entry
    return merged


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    return make_workload(1, (length, length), (1, 1), vocab, seed)[0].prompt_token_ids


# ---- timing on the engine ----------------------------------------------------------------------
def measure_prompt(llm: Any, prompt_ids: list[int]) -> float:
    """Seconds from submitting the prompt to its first token (prefill plus one sample)."""
    start, stamps = _token_times(llm, prompt_ids, 1)
    return stamps[0] - start


def measure_decode(llm: Any, prompt_ids: list[int], gen_len: int) -> tuple[float, int]:
    """(seconds from the first generated token to the last, tokens generated): decode steps only."""
    _, stamps = _token_times(llm, prompt_ids, gen_len)
    return (stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")), len(stamps)


def _token_times(llm: Any, prompt_ids: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """Drives the engine directly, as LLM.stream does, and stamps each token as its step returns.

    LLM.stream yields text, and a piece can hold several tokens or none (a split UTF-8 character),
    so it cannot time tokens; the engine's outputs carry the token ids themselves.
    """
    from tokenmill.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request_id = f"bench-latency-{time.monotonic_ns()}"
    stamps: list[float] = []
    start = time.perf_counter()
    llm.engine.add_request(request_id, prompt_ids, params)
    try:
        while llm.engine.has_unfinished():
            outs = llm.engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.request_id != request_id:
                    continue
                stamps.extend([now] * len(out.new_token_ids))
                if out.finished:
                    return start, stamps
    finally:
        llm.engine.abort_request(request_id)
    raise RuntimeError(f"the engine dropped {request_id} after {len(stamps)} tokens")


def _rates(rates: list[float]) -> dict:
    """Median and spread of per-run tokens/s; spread is (max - min) / median as in bench throughput."""
    median = statistics.median(rates)
    return {"tokens_per_s": median, "min": min(rates), "max": max(rates),
            "spread": (max(rates) - min(rates)) / median if median else 0.0, "runs": rates}


# ---- output ------------------------------------------------------------------------------------
def _print_report(report: dict, prompt_len: int, gen_len: int) -> None:
    s, c = report["settings"], report["ceilings_gflop_per_s"]
    load, load_end = s["load_average"], s["load_average_end"]
    wait = s["env"]["OMP_WAIT_POLICY"] or "default"
    loads = "n/a" if load is None else f"{load[0]:.2f} -> {load_end[0]:.2f}"
    pages = "2 MB" if s.get("weights_on_huge_pages") else "4 kB"
    print(f"threads {s['threads']} (OMP_WAIT_POLICY {wait}), precision {s['precision']}, weights on {pages} pages, "
          f"load average {loads}; ceilings fp32 {c['fp32']:.0f} GFLOP/s, bf16 {c['bf16']:.0f} GFLOP/s; "
          f"commit {s['git_commit']}")
    print(f"model {report['model']['path']}; pp{prompt_len}: random prompt to its first token; "
          f"tg{gen_len}: greedy after {s['decode_prompt_len']} prompt tokens, first token to last")
    if wait == "default" and s["threads"] > 1 and load is not None and load[0] > 1.0:
        print("note: other processes are running; with OpenMP's default spin-wait, several threads on shared "
              "cores can run many times slower: rerun with OMP_WAIT_POLICY=PASSIVE", file=sys.stderr)
    header = ("engine", "test", "tok/s", "min", "max", "spread", "ms/token", "GFLOP/s", "of ceiling")
    rows = [header]
    for engine, r in report["results"].items():
        for test, name in (("pp", f"pp{prompt_len}"), ("tg", f"tg{gen_len}")):
            t = r[test]
            rows.append((
                engine, name, f"{t['tokens_per_s']:.1f}", f"{t['min']:.1f}", f"{t['max']:.1f}",
                f"±{50 * t['spread']:.1f}%" if len(t["runs"]) > 1 else "-",
                f"{1000 / t['tokens_per_s']:.2f}" if t["tokens_per_s"] else "-",
                f"{t['gflop_per_s']:.1f}" if "gflop_per_s" in t else "-",
                f"{100 * t['fraction_of_ceiling']:.1f}%" if "fraction_of_ceiling" in t else "-",
            ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join([row[0].ljust(widths[0]), row[1].ljust(widths[1])]
                        + [cell.rjust(w) for cell, w in zip(row[2:], widths[2:])]))
    if report["model"]["token_weight_bytes"]:
        reads = ", ".join(f"{engine} {r['tg']['gb_per_s']:.1f} GB/s ({100 * r['tg']['fraction_of_read_ceiling']:.0f} %)"
                          for engine, r in report["results"].items())
        print(f"tg{gen_len} reads {report['model']['token_weight_bytes'] / 1e6:.1f} MB of weights a token, which "
              f"this machine reads at {report['read_ceiling_gb_per_s']:.1f} GB/s ({s['threads']} threads, best of "
              f"repeated sums): {reads}")
    if "ratios" in report:
        r, rounds = report["ratios"], report.get("round_ratios")
        how = "one run" if rounds is None else (
            f"median of {len(rounds)} rounds, the engines in turn: pp{prompt_len} "
            + " / ".join(f"{x['pp']:.2f}" for x in rounds) + f", tg{gen_len} " + " / ".join(f"{x['tg']:.2f}" for x in rounds))
        print(f"tokenmill / llama.cpp: pp{prompt_len} {r['pp']:.2f}x, tg{gen_len} {r['tg']:.2f}x "
              f"(same GGUF, {s['threads']} threads, {how})")
    for name, r in report["results"].items():
        for error in r["errors"]:
            print(f"error ({name}): {error}", file=sys.stderr)
