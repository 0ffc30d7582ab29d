"""`tokenmill bench model-switch`: does loading one model slow the streams of another? (issue 27)

Starts one `tokenmill serve --model A=... --model B=...` (default: the bundled SmolLM2 twice, under
two names: two engines, two pairs of processes) and warms A. Each repeat then:

1. baseline: streams to A back to back (`--output-tokens` each, greedy, ignore_eos) for
   `--baseline-seconds`; their chunk gaps are A's inter-token latencies with nothing else going on;
2. during a load: the same streams to A, and meanwhile one request to B, which is not loaded: its
   latency is B's load + its generation. The gaps of A's streams while B's request is in flight are
   the inter-token latencies during the load. B is then unloaded (Ollama's keep_alive 0) for the next
   repeat.

Reported per repeat: A's ITL p50/p99 without and during B's load and their p99 ratio (target <= 1.5),
B's first-request latency, the load time the server measured (/v1/models `load_seconds`), and B's
warm latency (the same request once loaded), so first <= load + warm can be read off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from tokenmill.bench.arg_types import at_least
from tokenmill.bench.server_launch import launch_server
from tokenmill.bench.tokenizer_stall import percentiles

PROMPT = "Once upon a time, in a small village by the sea,"


def start_server(models: list[str], extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    return launch_server([*extra, *(arg for model in models for arg in ("--model", model))], "switch", 120.0)


class Streams:
    """Streams to one model back to back in a thread, keeping every chunk's arrival time."""

    def __init__(self, url: str, model: str, output_tokens: int) -> None:
        self.url, self.model, self.output_tokens = url, model, output_tokens
        self.arrivals: list[list[float]] = []  # per stream: chunk times
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Streams:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": PROMPT, "stream": True, "max_tokens": self.output_tokens,
                "temperature": 0, "ignore_eos": True}
        while not self._stop.is_set():
            times: list[float] = []
            self.arrivals.append(times)
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        times.append(time.perf_counter())
                    if self._stop.is_set():
                        break

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Gaps between consecutive chunks of one stream that both arrived within [start, end]."""
        out = []
        for times in self.arrivals:
            out += [b - a for a, b in zip(times, times[1:]) if a >= start and b <= end]
        return out


def request_b(url: str, model: str, tokens: int) -> float:
    tic = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", timeout=900, json={
        "model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - tic


def card(url: str, model: str) -> dict[str, Any]:
    return next(m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"] if m["id"] == model)


def unload(url: str, model: str) -> None:
    httpx.post(f"{url}/api/generate", json={"model": model, "keep_alive": 0}, timeout=900).raise_for_status()
    deadline = time.monotonic() + 120
    while card(url, model)["loaded"] and time.monotonic() < deadline:
        time.sleep(0.2)


def one_repeat(url: str, args: argparse.Namespace) -> dict[str, Any]:
    with Streams(url, "A", args.output_tokens) as base:
        time.sleep(args.baseline_seconds)
    with Streams(url, "A", args.output_tokens) as during:
        time.sleep(1.0)  # A's stream is under way before B's request arrives
        sent = time.perf_counter()
        first = request_b(url, "B", args.b_tokens)
        done = time.perf_counter()
    warm = request_b(url, "B", args.b_tokens)
    load_s = card(url, "B")["load_seconds"]
    unload(url, "B")
    without, with_load = percentiles(base.gaps()), percentiles(during.gaps(sent, done))
    ratio = with_load["p99"] / without["p99"] if with_load["p99"] and without["p99"] else None
    return {"itl_ms_without": without, "itl_ms_during_load": with_load, "p99_ratio": ratio,
            "b_first_s": first, "b_load_s": load_s, "b_warm_s": warm,
            "first_minus_load_plus_warm_s": first - (load_s or 0.0) - warm}


def run(args: argparse.Namespace) -> int:
    from tokenmill.model.default_model import default_model_path

    a = args.model_a or default_model_path()
    b = args.model_b or a
    proc, url, log_path = start_server([f"A={a}", f"B={b}"], args.server_args.split())
    results = []
    try:
        request_b(url, "A", 4)  # A loads and warms up; B stays unloaded
        for repeat in range(args.repeats):
            result = {"repeat": repeat, **one_repeat(url, args)}
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    print(format_table(results))
    print(f"load average now: {os.getloadavg()}; server log: {log_path}", file=sys.stderr)
    return 0


def format_table(results: list[dict[str, Any]]) -> str:
    lines = ["| run | A's ITL p50 / p99 without (ms) | during B's load (ms) | p99 ratio | B first (s) | "
             "B load (s) | B warm (s) |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        w, d = r["itl_ms_without"], r["itl_ms_during_load"]

        def pair(p: dict) -> str:
            return f"{p['p50']:.0f} / {p['p99']:.0f}" if p["p50"] is not None else "-"

        ratio = f"{r['p99_ratio']:.2f}" if r["p99_ratio"] is not None else "-"
        lines.append(f"| {r['repeat'] + 1} | {pair(w)} ({w['n']}) | {pair(d)} ({d['n']}) | {ratio} | "
                     f"{r['b_first_s']:.1f} | {r['b_load_s'] or 0:.1f} | {r['b_warm_s']:.1f} |")
    return "\n".join(lines)


def add_model_switch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model-switch", help="a loaded model's inter-token latency while another model loads, "
                                            "and an unloaded model's first-request latency vs its load time")
    p.add_argument("--model-a", default=None, help="the streamed model (default: the bundled SmolLM2)")
    p.add_argument("--model-b", default=None, help="the model loaded meanwhile (default: model A's file again)")
    p.add_argument("--repeats", type=at_least(1), default=2)
    p.add_argument("--output-tokens", type=int, default=256, help="length of each stream to A")
    p.add_argument("--b-tokens", type=int, default=16, help="tokens B's request generates")
    p.add_argument("--baseline-seconds", type=float, default=15.0, help="how long A is streamed without a load")
    p.add_argument("--server-args", default="--num-threads 1",
                   help="more `tokenmill serve` arguments, one string (default: --num-threads 1)")
    p.set_defaults(func=run)
