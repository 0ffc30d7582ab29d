"""`tokenmill bench tokenizer-stall`: does a huge prompt stall the other streams? (issue 12)

For each `--workers` setting (0: tokenization in a thread of the API process; N: --tokenizer-workers N)
the command starts `tokenmill serve` with that setting, then at once: one streaming completion
(`--output-tokens`, greedy, ignore_eos) whose chunk gaps are the inter-token latencies; a /health
poller (every `--health-interval` s); and `--senders` clients that post ~`--huge-tokens`-token
prompts back to back while the stream runs. Those prompts are about 100k tokens of ordinary words:
under the untokenized length bound (len / longest token), so the server must tokenize them fully
before its length check rejects them (400 context_length_exceeded): exactly the stall case.

Reported per run: the stream's inter-token latency p50/p99/max, /health latency p50/p99/max, how
many huge prompts were sent and how long each took to be rejected. Each setting runs `--repeats`
times, each with a fresh server.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from tokenmill.bench.arg_types import at_least
from tokenmill.bench.server_launch import launch_server

WORDS = ["river", "mill", "quiet", "stone", "bread", "market", "winter", "lantern", "harbour", "orchard",
         "copper", "meadow", "violin", "thunder", "garden", "bridge", "pepper", "candle", "forest", "silver"]


def huge_prompt(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    # Words and 3-digit numbers (one token per digit in SmolLM2): ~2.3 tokens and ~5.3 characters a
    # piece, so the text stays under the length bound (characters / 81 < 8192) and must be tokenized.
    pieces = [rng.choice(WORDS) if rng.random() < 0.5 else str(rng.randint(100, 999)) for _ in range(tokens)]
    return " ".join(pieces[: int(tokens / 2.3)])


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50": statistics.median(ordered) * 1000, "p99": p99 * 1000, "max": ordered[-1] * 1000, "n": len(values)}


def start_server(workers: int, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    return launch_server(["--num-threads", str(threads), "--tokenizer-workers", str(workers), *extra], "stall")


def one_run(url: str, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    # Warm the path once (the workers' first template/encode, the engine's first step).
    httpx.post(f"{url}/v1/completions", timeout=120, json={"model": model, "prompt": "Hello", "max_tokens": 2})
    done = threading.Event()
    gaps: list[float] = []
    health: list[float] = []
    rejected: list[float] = []
    statuses: list[int] = []

    def stream() -> None:
        body = {"model": model, "prompt": "Once upon a time, in a small village by the sea,", "stream": True,
                "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True}
        last = None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
        done.set()

    def poll_health() -> None:
        while not done.is_set():
            tic = time.perf_counter()
            httpx.get(f"{url}/health", timeout=120)
            health.append(time.perf_counter() - tic)
            time.sleep(args.health_interval)

    def send_huge(k: int) -> None:
        i = k
        time.sleep(args.huge_delay)  # let the stream start first
        while not done.is_set():
            tic = time.perf_counter()
            r = httpx.post(f"{url}/v1/completions", timeout=600,
                           json={"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": 1})
            rejected.append(time.perf_counter() - tic)
            statuses.append(r.status_code)
            i += args.senders

    threads = [threading.Thread(target=stream), threading.Thread(target=poll_health)]
    threads += [threading.Thread(target=send_huge, args=(k,)) for k in range(args.senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"itl_ms": percentiles(gaps), "health_ms": percentiles(health), "huge_sent": len(rejected),
            "huge_statuses": sorted(set(statuses)), "huge_reject_s": percentiles(rejected)}


def run(args: argparse.Namespace) -> int:
    prompts = [huge_prompt(args.huge_tokens, seed) for seed in range(4)]
    if args.check_tokens:
        from tokenmill.frontend.tokenizer import Tokenizer
        from tokenmill.model.default_model import default_model_path

        tok = Tokenizer.from_model_path(default_model_path())
        print(f"huge prompts: {[len(tok.encode(p)) for p in prompts]} tokens, "
              f"{[len(p) for p in prompts]} characters, bound {[tok.min_token_count(p) for p in prompts]}",
              file=sys.stderr)
    results = []
    for workers in args.workers:
        for repeat in range(args.repeats):
            proc, url, log_path = start_server(workers, args.num_threads, args.server_args.split())
            try:
                result = {"workers": workers, "repeat": repeat, **one_run(url, args, prompts)}
            finally:
                proc.terminate()
                proc.wait(60)
            results.append(result)
            print(json.dumps(result), flush=True)
    print(format_table(results))
    return 0


def format_table(results: list[dict[str, Any]]) -> str:
    lines = ["| workers | run | ITL p50 / p99 / max (ms) | /health p50 / p99 / max (ms) | huge prompts (rejection s p50) |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        itl, health, huge = r["itl_ms"], r["health_ms"], r["huge_reject_s"]
        lines.append(f"| {r['workers']} | {r['repeat'] + 1} | {itl['p50']:.0f} / {itl['p99']:.0f} / {itl['max']:.0f} | "
                     f"{health['p50']:.0f} / {health['p99']:.0f} / {health['max']:.0f} | "
                     f"{r['huge_sent']} ({(huge['p50'] or 0) / 1000:.2f}) |")
    return "\n".join(lines)


def add_tokenizer_stall_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer-stall", help="stream + /health latency while ~100k-token prompts arrive, "
                                               "per --tokenizer-workers setting")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="--tokenizer-workers settings")
    p.add_argument("--repeats", type=at_least(1), default=2)
    p.add_argument("--num-threads", type=int, default=1, help="the server's scheduler threads")
    p.add_argument("--output-tokens", type=int, default=200, help="length of the measured stream")
    p.add_argument("--huge-tokens", type=int, default=100_000)
    p.add_argument("--senders", type=int, default=2, help="clients posting huge prompts back to back")
    p.add_argument("--huge-delay", type=float, default=0.5, help="seconds after the stream starts")
    p.add_argument("--health-interval", type=float, default=0.1)
    p.add_argument("--check-tokens", action="store_true", help="print the huge prompts' real token counts")
    p.add_argument("--server-args", default="", help="more `tokenmill serve` arguments, one string")
    p.set_defaults(func=run)
