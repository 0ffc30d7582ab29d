"""HTML reports with plots for `tokenmill bench serve` and `bench throughput` (`--report DIR`).

A table of percentiles hides a distribution's shape (a bimodal TTFT, a long ITL tail from one
preemption) and a trend across concurrency levels; plots show both at a glance. The report is one
self-contained HTML file (PNGs embedded as base64, so it opens anywhere, offline, and can be committed
as is) next to the PNGs themselves and the benchmark's full JSON. Rendering reads only that JSON, so
`tokenmill bench report RESULT.json --report DIR` redraws a recorded run without re-running it.

matplotlib runs on its Agg backend: no display, no GUI toolkit, the same pixels on every machine.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

# Per-request lists longer than this are shortened in the JSON shown inside the HTML (the full lists
# stay in result.json): a 16-stream run records ~100k inter-token gaps, megabytes of digits.
EMBED_LIST_MAX = 20
DPI = 80  # small PNGs: a report of three figures stays well under 1 MB


# ---- the data -------------------------------------------------------------------------------------
def kind_of(result: dict) -> str:
    """'serve' (a list of concurrency levels) or 'throughput' (one summary per engine)."""
    results = result.get("results") if isinstance(result, dict) else None
    if isinstance(results, list):
        return "serve"
    if isinstance(results, dict):
        return "throughput"
    raise ValueError("not a `tokenmill bench serve` or `bench throughput` result: no 'results' list or mapping")


def serve_engines(result: dict) -> list[tuple[str, list[dict]]]:
    """(label, levels) per server that ran, the command's --url first, then its --peer-url."""
    engines = [(_label(result["settings"].get("model"), result["settings"].get("url"), "server"), result["results"])]
    if "peer" in result:
        peer = result["peer"]
        engines.append((_label(peer.get("model"), peer.get("url"), "peer"), peer["results"]))
    return engines


def _label(model: str | None, url: str | None, fallback: str) -> str:
    host = (url or "").split("://")[-1].rstrip("/")
    return f"{fallback} {host}" if host else (model or fallback)


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and the fraction of values at or below each: a step-free empirical CDF."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.1f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---- plots ---------------------------------------------------------------------------------------
def _figure(rows: int, cols: int, width: float, height: float) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # before pyplot is imported anywhere: no display on a server
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    return fig, axes


def _cdf_axes(ax: Any, title: str, ylabel: str, values: Sequence[float]) -> None:
    """Labels and scale of a CDF panel; values spanning over 20x (a stall among ms gaps) get a log x
    axis, or the tail would squeeze the body into one vertical line."""
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("ms", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_ylim(0, 1.02)
    positive = [v for v in values if v > 0]
    if positive and max(positive) > 20 * min(positive):
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=7)


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def serve_cdf_png(result: dict) -> bytes | None:
    """TTFT (top row) and inter-token latency (bottom row) CDFs, one column per concurrency level,
    one line per server; None when the result kept no per-request latencies (older JSON)."""
    engines = serve_engines(result)
    if not any("ttfts_s" in level for _, levels in engines for level in levels):
        return None
    levels = [level["concurrency"] for level in engines[0][1]]
    fig, axes = _figure(2, len(levels), 3.4 * len(levels) + 0.6, 5.6)
    for col, concurrency in enumerate(levels):
        for row, (key, name) in enumerate((("ttfts_s", "TTFT"), ("itls_s", "inter-token latency"))):
            ax = axes[row][col]
            drawn: list[float] = []
            for label, results in engines:
                level = next((r for r in results if r["concurrency"] == concurrency), None)
                values = [1000 * v for v in (level or {}).get(key) or []]
                if values:
                    xs, ys = cdf(values)
                    ax.step(xs, ys, where="post", label=label)
                    drawn += values
            _cdf_axes(ax, f"{name}, concurrency {concurrency}",
                      "fraction of requests" if key == "ttfts_s" else "fraction of gaps", drawn)
    axes[0][0].legend(fontsize=7)
    return _png(fig)


def serve_trend_png(result: dict) -> bytes:
    """Output tokens/s and TTFT p50 (solid) / p99 (dashed) against concurrency, one colour per server."""
    fig, axes = _figure(1, 2, 9.0, 3.6)
    rate, ttft = axes[0]
    for i, (label, results) in enumerate(serve_engines(result)):
        color = f"C{i}"
        xs = [r["concurrency"] for r in results]
        rate.plot(xs, [r["output_tokens_per_s"] for r in results], "o-", color=color, label=label)
        for q, style in (("50", "o-"), ("99", "s--")):
            ys = [float("nan") if r[f"ttft_p{q}_s"] is None else 1000 * r[f"ttft_p{q}_s"] for r in results]
            ttft.plot(xs, ys, style, color=color, label=f"{label} p{q}")
    for ax, title, unit in ((rate, "output throughput", "tokens/s"), (ttft, "TTFT", "ms")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("concurrency", fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for _, rs in serve_engines(result) for r in rs})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    return _png(fig)


def throughput_bars_png(result: dict) -> bytes:
    """Output and total (prompt + output) tokens/s per engine, with the min-max range over repeats."""
    names = list(result["results"])
    fig, axes = _figure(1, 2, 8.0, 3.2)
    for ax, key, title in ((axes[0][0], "output_tokens_per_s", "output tokens/s"),
                           (axes[0][1], "total_tokens_per_s", "total tokens/s (prompt + output)")):
        values = [result["results"][n][key] for n in names]
        bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars, [f"{v:.1f}" for v in values], fontsize=8)
        ax.margins(y=0.12)  # room for the labels under the title
        if key == "output_tokens_per_s":
            lo = [v - result["results"][n].get("output_tokens_per_s_min", v) for n, v in zip(names, values)]
            hi = [result["results"][n].get("output_tokens_per_s_max", v) - v for n, v in zip(names, values)]
            ax.errorbar(names, values, yerr=[lo, hi], fmt="none", ecolor="black", capsize=4)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(labelsize=8)
    return _png(fig)


def throughput_cdf_png(result: dict) -> bytes | None:
    """Per-request TTFT and mean inter-token latency CDFs of the engines that recorded them (tokenmill's
    per-request metrics; a static-batch peer has none); None if no engine did."""
    engines = [(n, r["per_request"]) for n, r in result["results"].items() if r.get("per_request")]
    if not engines:
        return None
    fig, axes = _figure(1, 2, 8.0, 3.2)
    for ax, key, title in ((axes[0][0], "ttft_s", "TTFT (all requests submitted at once)"),
                           (axes[0][1], "itl_s", "mean inter-token latency per request")):
        drawn: list[float] = []
        for i, (name, per_request) in enumerate(engines):
            values = [1000 * v for v in per_request.get(key) or [] if v is not None]
            if values:
                xs, ys = cdf(values)
                ax.step(xs, ys, where="post", color=f"C{i}", label=name)
                drawn += values
        _cdf_axes(ax, title, "fraction of requests", drawn)
        ax.legend(fontsize=7)
    return _png(fig)


# ---- tables and the page -------------------------------------------------------------------------
def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def serve_tables(result: dict) -> str:
    parts = []
    header = ("concurrency", "requests", "output tok/s", "req/s", "TTFT p50 / p90 / p99 ms",
              "ITL p50 / p90 / p99 ms", "errors")
    for label, results in serve_engines(result):
        rows = [(str(r["concurrency"]), str(r["requests"]), _num(r["output_tokens_per_s"]),
                 _num(r["requests_per_s"], 2),
                 " / ".join(_ms(r[f"ttft_p{q}_s"]) for q in (50, 90, 99)),
                 " / ".join(_ms(r[f"itl_p{q}_s"]) for q in (50, 90, 99)), str(r["num_errors"]))
                for r in results]
        parts.append(f"<h3>{html.escape(label)}</h3>" + _table(header, rows))
    if result.get("ratios"):
        rows = [(str(r["concurrency"]), _num(r["output_tokens_per_s"], 2), _num(r["ttft_p99"], 2))
                for r in result["ratios"]]
        parts.append("<h3>server / peer</h3>" + _table(("concurrency", "output tok/s ratio",
                                                          "TTFT p99 ratio (lower is better)"), rows))
    return "".join(parts)


def throughput_tables(result: dict) -> str:
    header = ("engine", "requests", "prompt tok", "output tok", "seconds", "output tok/s", "total tok/s",
              "of ceiling")
    rows = [(name, str(r["requests"]), str(r["prompt_tokens"]), str(r["output_tokens"]), _num(r["seconds"], 2),
             _num(r["output_tokens_per_s"]), _num(r["total_tokens_per_s"]), f"{100 * r['fraction_of_ceiling']:.1f}%")
            for name, r in result["results"].items()]
    table = _table(header, rows)
    if "ratio_output_tokens_per_s" in result:
        table += f"<p>tokenmill / transformers output tokens/s: {result['ratio_output_tokens_per_s']:.2f}x</p>"
    return table


def shortened(value: Any) -> Any:
    """The result with long per-request lists cut to their first EMBED_LIST_MAX values and a count."""
    if isinstance(value, dict):
        return {k: shortened(v) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > EMBED_LIST_MAX and all(isinstance(v, (int, float)) or v is None for v in value):
            return [*value[:EMBED_LIST_MAX], f"... {len(value) - EMBED_LIST_MAX} more in result.json"]
        return [shortened(v) for v in value]
    return value


_STYLE = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}"
          "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
          "text-align:right;font-size:13px}img{max-width:100%}pre{font-size:11px;background:#f6f6f6;"
          "padding:1em;overflow:auto}")


def render(result: dict, kind: str | None = None) -> tuple[str, dict[str, bytes]]:
    """The page and its figures (name -> PNG bytes) for one benchmark result."""
    kind = kind or kind_of(result)
    settings = result.get("settings", {})
    if kind == "serve":
        title = f"tokenmill bench serve: {settings.get('model', '?')}"
        figures = {"latency_cdf.png": serve_cdf_png(result), "vs_concurrency.png": serve_trend_png(result)}
        tables = serve_tables(result)
        about = (f"~{settings.get('prompt_words')}-word prompts, {settings.get('output_tokens')} output tokens, "
                 f"greedy, ignore_eos {settings.get('ignore_eos')}; concurrency {settings.get('concurrency')}; "
                 f"{settings.get('date', '')}")
    else:
        title = "tokenmill bench throughput"
        figures = {"throughput.png": throughput_bars_png(result), "latency_cdf.png": throughput_cdf_png(result)}
        tables = throughput_tables(result)
        load = settings.get("load_average")
        about = (f"threads {settings.get('threads')}, precision {settings.get('precision')}, commit "
                 f"{settings.get('git_commit')}, load average {load[0] if load else 'n/a'}; "
                 f"{settings.get('date', '')}")
    pngs = {name: data for name, data in figures.items() if data is not None}
    images = "".join(
        f'<p><img alt="{html.escape(name)}" src="data:image/png;base64,{base64.b64encode(data).decode()}"></p>'
        for name, data in pngs.items())
    if len(pngs) < len(figures):
        images += "<p>Per-request latencies were not recorded in this result (an older format): no CDFs.</p>"
    embedded = html.escape(json.dumps(shortened(result), indent=2))
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1><p>{html.escape(about)}</p>"
            f"{images}<h2>Numbers</h2>{tables}<h2>Result JSON</h2><p>Full lists in result.json next to this "
            f"file.</p><details><summary>show</summary><pre>{embedded}</pre></details></body></html>")
    return page, pngs


def write_report(result: dict, directory: str, kind: str | None = None) -> str:
    """Writes DIR/index.html, DIR/result.json and the PNGs; returns the HTML's path."""
    page, pngs = render(result, kind)
    os.makedirs(directory, exist_ok=True)
    for name, data in pngs.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
    with open(os.path.join(directory, "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    path = os.path.join(directory, "index.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


# ---- `tokenmill bench report` --------------------------------------------------------------------
def add_report_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("report", help="redraw the HTML report of a saved bench serve / throughput JSON")
    p.add_argument("result", help="JSON written by `bench serve --json` / `bench throughput --json` (or a "
                                  "report's result.json)")
    p.add_argument("--report", metavar="DIR", required=True, help="write index.html, the PNGs and result.json here")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    try:
        with open(args.result) as f:
            result = json.load(f)
        kind = kind_of(result)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read a benchmark result from {args.result}: {exc}", file=sys.stderr)
        return 2
    print(f"report: {write_report(result, args.report, kind)}")
    return 0
