"""`tokenmill bench serve --url URL`: the online-serving workload against any OpenAI-compatible server.

At each fixed concurrency level, that many clients send streaming /v1/completions requests back to
back: text prompts of ~250 tokens (seeded random common words, the same for every server), 128 output
tokens, greedy, `ignore_eos` in the body (servers that do not know the field ignore it and may stop
early: the output token count says so). Reported per level: TTFT and inter-token latency
p50/p90/p99, output tokens/s, requests/s and errors. Only the HTTP API is used, so peers (vLLM,
llama.cpp's server, ...) are measured with the same requests. With `--peer-url` a second server gets
the same requests in the same command, level by level right after the first (so both see about the
same machine load), and the ratios of output tokens/s and TTFT p99 are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

# Short, common English words: nearly all are one token each (with their leading space) in the
# BPE vocabularies of the models we serve, so N words make a prompt of about N tokens.
_WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "hot", "word", "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an", "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write", "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go", "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water", "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "any", "new", "work", "part", "take", "get", "place", "made", "live", "where", "after", "back", "little", "only", "round", "man", "year", "came", "show", "every", "good", "me", "give", "our", "under", "name", "very", "through", "just", "form", "sentence", "great", "think", "say", "help", "low", "line", "differ", "turn", "cause", "much", "mean", "before", "move", "right", "boy", "old", "too", "same", "tell", "does", "set", "three", "want", "air", "well", "also", "play", "small", "end", "put", "home", "read", "hand", "port", "large", "spell", "add", "even", "land", "here", "must", "big", "high", "such", "follow", "act", "why", "ask", "men", "change", "went", "light", "kind", "off", "need", "house", "picture", "try", "us", "again", "animal", "point", "mother", "world", "near", "build", "self", "earth", "father", "head", "stand", "own", "page", "should", "country", "found"]


@dataclass
class Sample:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None


def add_serve_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="online serving: fixed-concurrency streaming load on an OpenAI API")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default: 2 x concurrency, >= 4)")
    p.add_argument("--prompt-words", type=int, default=250, help="words per prompt (~tokens)")
    p.add_argument("--shared-prefix-words", type=int, default=0,
                   help="words of a system prompt every request starts with, before its own --prompt-words "
                        "(a prefix cache can share it)")
    p.add_argument("--shared-prefixes", type=int, default=1,
                   help="with --shared-prefix-words: that many distinct system prompts, the requests dealt out over "
                        "them in turn")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for strict servers)")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--json", metavar="PATH", default=None, help="write settings and results here")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="write an HTML report with plots (latency CDFs, rates against concurrency) here")
    g = p.add_argument_group("peer")
    g.add_argument("--peer-url", default=None,
                   help="a second OpenAI-compatible server (e.g. llama-server) sent the same requests; "
                        "ratios of output tok/s and TTFT p99 are printed")
    g.add_argument("--peer-model", default=None, help="model name on the peer (default: the first of its /v1/models)")
    g.add_argument("--peer-api-key", default=None)
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        print(f"error: --concurrency must be integers separated by commas, got {args.concurrency!r}", file=sys.stderr)
        return 2
    if not levels or min(levels) < 1:
        print("error: concurrency levels must be >= 1", file=sys.stderr)
        return 2
    if args.shared_prefixes < 1:
        print(f"error: --shared-prefixes must be >= 1, got {args.shared_prefixes}", file=sys.stderr)
        return 2
    report = asyncio.run(_run(args, levels))
    if report is None:
        return 1
    _print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.report:
        from tokenmill.bench.report import write_report

        print(f"report: {write_report(report, args.report, 'serve')}")
    peer_results = report["peer"]["results"] if "peer" in report else []
    return 1 if any(r["errors"] for r in [*report["results"], *peer_results]) else 0


def make_prompts(count: int, words: int, seed: int, shared_words: int = 0, prefixes: int = 1) -> list[str]:
    """`count` prompts of `words` random words; with `shared_words`, each after one of `prefixes`
    system prompts of that many words (prompt i after prefix i % prefixes)."""
    rng = random.Random(seed)  # fixed sequence across versions: every server sees the same prompts
    own = [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(count)]
    if shared_words <= 0:
        return own
    # Each its own stream, so that the own parts are the same with or without shared prefixes (and the
    # first prefix the same with one or several).
    streams = [random.Random(f"shared-{seed}" if j == 0 else f"shared-{seed}-{j}") for j in range(prefixes)]
    shared = [" ".join(r.choice(_WORDS) for _ in range(shared_words)) for r in streams]
    return [f"{shared[i % prefixes]} {text}" for i, text in enumerate(own)]


@dataclass
class _Server:
    base: str
    model: str
    client: Any
    body: dict


async def _run(args: argparse.Namespace, levels: list[int]) -> dict | None:
    import httpx  # only this command needs it

    targets = [(args.url, args.model, args.api_key)]
    if args.peer_url:
        targets.append((args.peer_url, args.peer_model, args.peer_api_key))
    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for url, model, api_key in targets:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            base = url.rstrip("/")
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=base, headers=headers, timeout=args.timeout))
            if model is None:
                try:
                    resp = await client.get("/v1/models")
                    resp.raise_for_status()
                    model = resp.json()["data"][0]["id"]
                except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                    print(f"error: cannot list models at {base}/v1/models: {exc}", file=sys.stderr)
                    return None
            body = {"model": model, "max_tokens": args.output_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            if not args.no_ignore_eos:
                body["ignore_eos"] = True
            servers.append(_Server(base, model, client, body))
        for server in servers:
            # Warm-up: pays one-time costs (kernel selection, first allocation) outside the timed levels.
            await _one(server.client, {**server.body, "max_tokens": 4},
                       make_prompts(1, 16, args.workload_seed + 1)[0])
        results: list[list[dict]] = [[] for _ in servers]
        for level in levels:
            n = args.requests or max(4, 2 * level)
            prompts = make_prompts(n, args.prompt_words, args.workload_seed + level, args.shared_prefix_words,
                                   args.shared_prefixes)
            # Level by level, one server right after the other: a change in the machine's load during
            # the run then hits both sides of a ratio alike.
            for server, server_results in zip(servers, results):
                start = time.perf_counter()
                samples = await _level(server.client, server.body, prompts, level)
                server_results.append(_summarize(level, samples, time.perf_counter() - start))
    main = servers[0]
    report: dict[str, Any] = {
        "settings": {"url": main.base, "model": main.model, "concurrency": levels, "prompt_words": args.prompt_words,
                     "shared_prefix_words": args.shared_prefix_words, "shared_prefixes": args.shared_prefixes,
                     "output_tokens": args.output_tokens, "ignore_eos": not args.no_ignore_eos,
                     "workload_seed": args.workload_seed, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "results": results[0],
    }
    if len(servers) > 1:
        report["peer"] = {"url": servers[1].base, "model": servers[1].model, "results": results[1]}
        report["ratios"] = [peer_ratios(a, b) for a, b in zip(results[0], results[1])]
    return report


def peer_ratios(ours: dict, peer: dict) -> dict:
    """Server / peer at one level: output tok/s (higher is better) and TTFT p99 (lower is better)."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {"concurrency": ours["concurrency"],
            "output_tokens_per_s": ratio(ours["output_tokens_per_s"], peer["output_tokens_per_s"]),
            "ttft_p99": ratio(ours["ttft_p99_s"], peer["ttft_p99_s"])}


async def _level(client: Any, body: dict, prompts: list[str], concurrency: int) -> list[Sample]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    samples: list[Sample] = []

    async def worker() -> None:
        while not queue.empty():
            samples.append(await _one(client, body, queue.get_nowait()))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def _one(client: Any, body: dict, prompt: str) -> Sample:
    """One streaming request; TTFT is to the first chunk carrying text, ITL the gaps between such chunks."""
    import httpx

    sample = Sample(ok=False)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                sample.error = f"HTTP {resp.status_code}: {text[:200]}"
                return sample
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if payload.get("error"):
                    sample.error = str(payload["error"].get("message", payload["error"]))
                    return sample
                if payload.get("usage"):
                    sample.output_tokens = payload["usage"].get("completion_tokens", 0)
                    sample.prompt_tokens = payload["usage"].get("prompt_tokens")
                if any(c.get("text") for c in payload.get("choices") or []):
                    now = time.perf_counter()
                    if sample.ttft is None:
                        sample.ttft = now - start
                    else:
                        sample.itls.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, ValueError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    if not sample.output_tokens:
        sample.output_tokens = chunks  # no usage in the stream: one chunk is about one token
    sample.ok = sample.ttft is not None
    if not sample.ok:
        sample.error = "no text came back"
    return sample


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _summarize(level: int, samples: list[Sample], seconds: float) -> dict:
    ok = [s for s in samples if s.ok]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    itls = [x for s in ok for x in s.itls]
    out_tokens = sum(s.output_tokens for s in ok)
    prompt = [s.prompt_tokens for s in ok if s.prompt_tokens]
    return {
        "concurrency": level,
        "requests": len(samples),
        "seconds": seconds,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / seconds if seconds > 0 else 0.0,
        "requests_per_s": len(ok) / seconds if seconds > 0 else 0.0,
        "mean_prompt_tokens": sum(prompt) / len(prompt) if prompt else None,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        **{f"ttft_p{q}_s": percentile(ttfts, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_s": percentile(itls, q) for q in (50, 90, 99)},
        # Every value, for the report's CDFs (percentiles alone hide a distribution's shape); microseconds
        # are plenty and keep a long run's JSON small.
        "ttfts_s": [round(x, 6) for x in ttfts],
        "itls_s": [round(x, 6) for x in itls],
        "errors": sorted({s.error for s in samples if s.error}),
        "num_errors": sum(1 for s in samples if not s.ok),
    }


def _print_report(report: dict) -> None:
    s = report["settings"]
    shared = ""
    if s.get("shared_prefix_words"):
        many = s.get("shared_prefixes", 1)
        shared = (f" after one of {many} shared {s['shared_prefix_words']}-word prefixes" if many > 1
                  else f" after a shared {s['shared_prefix_words']}-word prefix")
    print(f"{s['url']} model {s['model']}: ~{s['prompt_words']}-word prompts{shared}, {s['output_tokens']} output tokens, "
          f"greedy, ignore_eos {'on' if s['ignore_eos'] else 'off'}")
    _print_table(report["results"])
    if "peer" in report:
        peer = report["peer"]
        print(f"peer {peer['url']} model {peer['model']}: the same requests")
        _print_table(peer["results"], "peer ")

        def x(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}x"

        print(f"{s['url']} / peer:")
        for r in report["ratios"]:
            print(f"  concurrency {r['concurrency']}: output tok/s {x(r['output_tokens_per_s'])}, "
                  f"TTFT p99 {x(r['ttft_p99'])} (lower is better)")


def _print_table(results: list[dict], who: str = "") -> None:
    header = ("conc", "reqs", "prompt tok", "out tok", "out tok/s", "req/s", "TTFT p50/p90/p99 ms",
              "ITL p50/p90/p99 ms", "errors")
    rows = [header]

    def ms(*values: float | None) -> str:
        return "/".join("-" if v is None else f"{1000 * v:.0f}" for v in values)

    for r in results:
        rows.append((
            str(r["concurrency"]), str(r["requests"]),
            "-" if r["mean_prompt_tokens"] is None else f"{r['mean_prompt_tokens']:.0f}",
            f"{r['mean_output_tokens']:.0f}", f"{r['output_tokens_per_s']:.1f}", f"{r['requests_per_s']:.2f}",
            ms(r["ttft_p50_s"], r["ttft_p90_s"], r["ttft_p99_s"]), ms(r["itl_p50_s"], r["itl_p90_s"], r["itl_p99_s"]),
            str(r["num_errors"]),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    for r in results:
        for error in r["errors"]:
            print(f"error ({who}concurrency {r['concurrency']}): {error}", file=sys.stderr)
