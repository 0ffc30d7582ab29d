"""`tokenmill bench soak`: memory under steady load. Does any server process grow?

N clients stream /v1/completions back to back for M minutes (prompts and output lengths vary, so
step shapes vary; a share of the clients disconnect mid-stream, so aborts are mixed in), while every
few seconds each server process (API server, scheduler, detokenizer) is sampled from /proc: RSS,
the `[heap]` mapping's resident size, anonymous memory, and for the scheduler the resident pages of
the KV pool (torch.empty: the pool's pages become resident as they are first written and the prefix
cache keeps them, so RSS grows with KV use alone; each scheduler writes its pool's address ranges
into $TOKENMILL_KV_POOL_DIR, engine/memory_trim.py). Growth is measured after a warm-up (the first 20%
of the run): the exit status is 1 when any process's RSS outside the KV pool grew by more than
`--max-growth` percent from the end of the warm-up to the end of the run (means over the first and
the last 10% of the run after the warm-up, see `growth`).

Without `--url` the command starts `tokenmill serve` itself (`--server-args` are passed on); with
`--url`, `--server-pid` names the running server's main process (its children are found by the
`--parent-pid` on their command lines) and `--kv-pool-dir` the directory its $TOKENMILL_KV_POOL_DIR
named. After the load stops, one more sample shows what each process keeps when idle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.serve import make_prompts
from tokenmill.engine.memory_trim import KV_POOL_DIR_ENV, kv_pool_file

MB = 1024 * 1024
IDLE_SETTLE_S = 5.0
PAGE = os.sysconf("SC_PAGE_SIZE")
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


@dataclass
class Mapping:
    start: int
    end: int
    name: str
    rss: int  # bytes
    anonymous: int  # bytes


def parse_smaps(text: str) -> list[Mapping]:
    """/proc/PID/smaps: one entry per mapping with its resident and anonymous bytes."""
    out: list[Mapping] = []
    for line in text.splitlines():
        m = _MAPPING.match(line)
        if m:
            out.append(Mapping(int(m.group(1), 16), int(m.group(2), 16), m.group(3).strip(), 0, 0))
        elif out and line.startswith("Rss:"):
            out[-1].rss = int(line.split()[1]) * 1024
        elif out and line.startswith("Anonymous:"):
            out[-1].anonymous = int(line.split()[1]) * 1024
    return out


def resident_in(pid: int, ranges: list[tuple[int, int]]) -> int:
    """Resident bytes inside the address ranges, page by page from /proc/PID/pagemap (bit 63: page
    present; readable without privileges, which only hide the frame numbers). smaps would not do:
    the KV tensors may sit inside the [heap] mapping beside everything else."""
    import numpy as np

    present = 0
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        for start, end in ranges:
            first, last = start // PAGE, (end + PAGE - 1) // PAGE
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first) * 8), dtype=np.uint64)
            present += int(np.count_nonzero(entries >> np.uint64(63)))
    return present * PAGE


def sample_process(pid: int, kv_ranges: list[tuple[int, int]] | None) -> dict[str, float]:
    """MB figures of one process: rss, heap (the [heap] mapping), anon, kv (resident pool pages)."""
    with open(f"/proc/{pid}/smaps") as f:
        mappings = parse_smaps(f.read())
    rss = sum(m.rss for m in mappings)
    kv = resident_in(pid, kv_ranges) if kv_ranges else 0
    return {"rss": rss / MB, "heap": sum(m.rss for m in mappings if m.name == "[heap]") / MB,
            "anon": sum(m.anonymous for m in mappings) / MB, "kv": kv / MB, "outside_kv": (rss - kv) / MB}


def growth(times: list[float], values: list[float], warmup_fraction: float,
           window_fraction: float = 0.1) -> dict[str, float] | None:
    """Growth after warm-up: the mean of the samples in the first `window_fraction` of the run after
    the warm-up (`warmup_fraction`) against the mean of those in its last `window_fraction`, in MB and
    percent, plus the peak after warm-up. Means, not single samples: the scheduler trims its heap once
    a minute under load, so its RSS is a saw-tooth, and two single samples may compare a trough with a
    peak. None with fewer than two samples after the warm-up."""
    if len(times) < 2:
        return None
    window = (times[-1] - times[0]) * window_fraction
    cut = times[0] + (times[-1] - times[0]) * warmup_fraction
    after = [(t, v) for t, v in zip(times, values) if t >= cut]
    if len(after) < 2:
        return None
    first = [v for t, v in after if t <= after[0][0] + window]
    last = [v for t, v in after if t >= after[-1][0] - window]
    base, end = sum(first) / len(first), sum(last) / len(last)
    return {"start_mb": values[0], "warm_mb": base, "end_mb": end, "peak_mb": max(v for _, v in after),
            "growth_mb": end - base, "growth_pct": (end - base) / base * 100 if base else 0.0}


def add_soak_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("soak", help="memory under load: streams with aborts for minutes, RSS sampled")
    p.add_argument("--url", default=None, help="a running server (default: start `tokenmill serve` here)")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's main process id")
    p.add_argument("--kv-pool-dir", default=None,
                   help="with --url: the directory the server's $TOKENMILL_KV_POOL_DIR named")
    p.add_argument("--server-args", default="--num-threads 1",
                   help="arguments for the `tokenmill serve` this command starts")
    p.add_argument("--streams", type=int, default=32, help="concurrent streaming clients")
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--abort-fraction", type=float, default=0.25,
                   help="share of requests whose client disconnects mid-stream")
    p.add_argument("--prompt-words", default="20,400", help="min,max words per prompt (~tokens)")
    p.add_argument("--output-tokens", default="8,160", help="min,max output tokens")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--warmup-fraction", type=float, default=0.2)
    p.add_argument("--max-growth", type=float, default=5.0,
                   help="percent growth of RSS outside the KV pool after warm-up that fails the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="write settings, samples and growth here")
    p.set_defaults(func=cmd_bench_soak)


def _pair(text: str, name: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise SystemExit(f"error: {name} must be MIN,MAX integers, got {text!r}") from None
    if not 1 <= a <= b:
        raise SystemExit(f"error: {name} must satisfy 1 <= MIN <= MAX, got {text!r}")
    return a, b


def find_processes(server_pid: int) -> dict[str, int]:
    """The server's main process and its children, named by role (from their command lines)."""
    found = {"api_server": server_pid}
    marker = f"--parent-pid\0{server_pid}\0".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read() + b"\0"
        except OSError:
            continue
        if marker in cmdline:
            role = re.search(rb"tokenmill\.\w+\.(\w+)_process", cmdline)
            name = role.group(1).decode() if role else f"child{entry}"
            found[name if name not in found else f"{name}-{entry}"] = int(entry)
    return found


def cmd_bench_soak(args: argparse.Namespace) -> int:
    words, outputs = _pair(args.prompt_words, "--prompt-words"), _pair(args.output_tokens, "--output-tokens")
    if args.url and args.server_pid is None:
        print("error: --url needs --server-pid (the processes to sample)", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if args.url:
            url, pid, kv_dir = args.url.rstrip("/"), args.server_pid, args.kv_pool_dir
        else:
            url, pid, kv_dir = stack.enter_context(_started_server(args.server_args))
        report = asyncio.run(_soak(args, url, pid, kv_dir, words, outputs))
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if report["failed"] else 0


@contextlib.contextmanager
def _started_server(server_args: str) -> Any:
    """`tokenmill serve` on a free port with the KV pool map requested; yields (url, pid, map file)."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="tokenmill-soak-")
    log_path = os.path.join(workdir, "serve.log")
    script = os.path.join(os.path.dirname(sys.executable), "tokenmill")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "tokenmill.entrypoints.cli"]
    cmd += ["serve", "--port", str(port), *shlex.split(server_args)]
    env = {**os.environ, KV_POOL_DIR_ENV: workdir}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"error: tokenmill serve exited with {proc.returncode}; log: {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"error: tokenmill serve not healthy after 300 s; log: {log_path}")
            time.sleep(0.5)
        print(f"soak: server pid {proc.pid} at {url} (log {log_path})", file=sys.stderr)
        yield url, proc.pid, workdir
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kv_ranges(kv_dir: str | None, pid: int) -> list[tuple[int, int]] | None:
    if not kv_dir:
        return None
    try:
        with open(kv_pool_file(kv_dir, pid)) as f:
            return [(int(s), int(e)) for s, e in json.load(f)["ranges"]]
    except (OSError, ValueError, KeyError):
        return None


async def _soak(args: argparse.Namespace, url: str, server_pid: int, kv_dir: str | None,
                words: tuple[int, int], outputs: tuple[int, int]) -> dict[str, Any]:
    import httpx

    procs = find_processes(server_pid)
    counts = {"requests": 0, "completed": 0, "aborted": 0, "errors": 0, "output_tokens": 0}
    errors: list[str] = []
    rng = random.Random(args.seed)
    prompts = make_prompts(64, words[1], args.seed)
    duration = args.minutes * 60
    start = time.monotonic()
    stop_at = start + duration
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one() -> None:
            n_words = rng.randint(*words)
            body = {"model": model, "prompt": " ".join(rng.choice(prompts).split()[:n_words]),
                    "max_tokens": rng.randint(*outputs), "temperature": rng.choice([0.0, 0.8]),
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            # An aborting client leaves after a random few chunks, mid-stream.
            abort_after = rng.randint(1, 8) if rng.random() < args.abort_fraction else None
            counts["requests"] += 1
            chunks = 0
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    payload = json.loads(line[5:])
                    if payload.get("error"):
                        raise RuntimeError(str(payload["error"])[:200])
                    chunks += 1
                    if payload.get("usage"):
                        counts["output_tokens"] += payload["usage"].get("completion_tokens", 0)
                    if abort_after is not None and chunks >= abort_after:
                        counts["aborted"] += 1
                        return  # leaving the block closes the connection: the server aborts
            counts["completed"] += 1

        async def client_loop() -> None:
            while time.monotonic() < stop_at:
                try:
                    await one()
                except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                    counts["errors"] += 1
                    if len(errors) < 20:
                        errors.append(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.5)

        samples: list[dict[str, Any]] = []
        kv_ranges = {name: _kv_ranges(kv_dir, pid) for name, pid in procs.items()}

        def take_sample() -> dict[str, Any]:
            for name, pid in procs.items():  # the map is written while the scheduler starts
                kv_ranges[name] = kv_ranges[name] or _kv_ranges(kv_dir, pid)
            row: dict[str, Any] = {"t": round(time.monotonic() - start, 1), "requests": counts["requests"]}
            for name, pid in procs.items():
                with contextlib.suppress(OSError):
                    row[name] = sample_process(pid, kv_ranges[name])
            print(_row_text(row, procs), file=sys.stderr, flush=True)
            return row

        async def sampler() -> None:
            while True:
                samples.append(take_sample())
                if time.monotonic() >= stop_at:
                    return
                await asyncio.sleep(min(args.interval, max(0.0, stop_at - time.monotonic())))

        clients = [asyncio.create_task(client_loop()) for _ in range(args.streams)]
        await sampler()
        # Streams still running at the end are dropped (the server aborts them) rather than waited
        # for: under load one can take minutes, and the idle sample should follow the load at once.
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await asyncio.sleep(IDLE_SETTLE_S)  # the engine goes idle (and trims) once the last stream ends
        idle = take_sample()
    result: dict[str, Any] = {}
    for name in procs:
        rows = [s for s in samples if name in s]
        times = [s["t"] for s in rows]
        result[name] = {key: growth(times, [s[name][key] for s in rows], args.warmup_fraction)
                        for key in ("outside_kv", "rss", "heap", "kv")}
        for key, g in result[name].items():
            if g is not None and name in idle:
                g["idle_mb"] = idle[name][key]
    failed = [n for n, g in result.items()
              if g["outside_kv"] is not None and g["outside_kv"]["growth_pct"] > args.max_growth]
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    return {"settings": {**settings, "url": url, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "processes": procs, "counts": counts, "errors": errors, "samples": samples, "idle": idle,
            "growth": result,
            "failed": failed}


def _row_text(row: dict[str, Any], procs: dict[str, int]) -> str:
    parts = [f"t={row['t']:7.1f}s req={row['requests']:6d}"]
    for name in procs:
        if name in row:
            m = row[name]
            parts.append(f"{name} rss {m['rss']:7.1f} outside-kv {m['outside_kv']:7.1f} heap {m['heap']:6.1f}"
                         + (f" kv {m['kv']:6.1f}" if m["kv"] else ""))
    return " | ".join(parts)


def print_report(report: dict[str, Any]) -> None:
    c = report["counts"]
    print(f"requests {c['requests']}  completed {c['completed']}  aborted {c['aborted']}  errors {c['errors']}  "
          f"output tokens {c['output_tokens']}")
    for e in report["errors"][:5]:
        print(f"  error: {e}")
    print(f"{'process':<12} {'metric':<11} {'start MB':>9} {'warm MB':>9} {'end MB':>9} {'peak MB':>9} "
          f"{'growth MB':>10} {'growth %':>9} {'idle MB':>9}")
    for name, metrics in report["growth"].items():
        for key, g in metrics.items():
            if g is None or (key == "kv" and not g["peak_mb"]):
                continue
            print(f"{name:<12} {key:<11} {g['start_mb']:9.1f} {g['warm_mb']:9.1f} {g['end_mb']:9.1f} "
                  f"{g['peak_mb']:9.1f} {g['growth_mb']:10.1f} {g['growth_pct']:9.2f} {g.get('idle_mb', 0.0):9.1f}")
    limit = report["settings"]["max_growth"]
    if report["failed"]:
        print(f"FAIL: RSS outside the KV pool grew more than {limit}% after warm-up: {', '.join(report['failed'])}")
    else:
        print(f"OK: RSS outside the KV pool within {limit}% after warm-up in every process")
