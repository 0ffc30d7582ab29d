"""`--report DIR` of `tokenmill bench serve` / `bench throughput`, and `tokenmill bench report`: the HTML
holds real PNGs and the numbers of the result it was drawn from."""

from __future__ import annotations

import base64
import json
import re

import pytest

from tests.server.test_bench_serve_peer import fake_server
from tokenmill.bench.report import cdf, kind_of, render, shortened, write_report
from tokenmill.entrypoints.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _level(concurrency: int, rate: float, ttft: float) -> dict:
    ttfts = [ttft * (1 + i / 10) for i in range(2 * concurrency)]
    itls = [0.02 + 0.001 * i for i in range(40)]
    return {"concurrency": concurrency, "requests": len(ttfts), "seconds": 2.0, "output_tokens": 100,
            "output_tokens_per_s": rate, "requests_per_s": 1.5, "mean_prompt_tokens": 250.0,
            "mean_output_tokens": 128.0, "ttft_p50_s": ttft, "ttft_p90_s": 1.5 * ttft, "ttft_p99_s": 2 * ttft,
            "itl_p50_s": 0.021, "itl_p90_s": 0.035, "itl_p99_s": 0.059, "errors": [], "num_errors": 0,
            "ttfts_s": ttfts, "itls_s": itls}


def serve_result() -> dict:
    ours = [_level(1, 41.5, 0.1), _level(4, 123.4, 0.2), _level(16, 333.7, 0.4)]
    peer = [_level(1, 38.2, 0.15), _level(4, 61.9, 0.5), _level(16, 87.9, 1.7)]
    return {"settings": {"url": "http://127.0.0.1:8000", "model": "smol", "concurrency": [1, 4, 16],
                         "prompt_words": 250, "output_tokens": 128, "ignore_eos": True, "workload_seed": 0},
            "results": ours,
            "peer": {"url": "http://127.0.0.1:8081", "model": "smol-gguf", "results": peer},
            "ratios": [{"concurrency": a["concurrency"], "output_tokens_per_s": a["output_tokens_per_s"] / b[
                "output_tokens_per_s"], "ttft_p99": a["ttft_p99_s"] / b["ttft_p99_s"]} for a, b in zip(ours, peer)]}


def throughput_result() -> dict:
    def engine(rate: float, per_request: dict | None) -> dict:
        out = {"requests": 3, "prompt_tokens": 36, "output_tokens": 18, "seconds": 18 / rate,
               "output_tokens_per_s": rate, "total_tokens_per_s": 54 / (18 / rate), "output_tokens_per_s_min": rate,
               "output_tokens_per_s_max": rate, "spread": 0.0, "fraction_of_ceiling": 0.25, "runs": [], "errors": []}
        if per_request is not None:
            out["per_request"] = per_request
        return out

    return {"settings": {"threads": 1, "precision": "fast", "git_commit": "abc", "load_average": [1.0, 1.0, 1.0]},
            "results": {"tokenmill": engine(363.7, {"ttft_s": [0.1, 0.2, 0.3], "itl_s": [0.01, None, 0.02]}),
                        "transformers": engine(34.8, None)},
            "ratio_output_tokens_per_s": 363.7 / 34.8}


def images(page: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_serve_report_has_both_figures_and_every_engines_numbers():
    page, pngs = render(serve_result())
    assert set(pngs) == {"latency_cdf.png", "vs_concurrency.png"}
    found = images(page)
    assert len(found) == 2 and found == list(pngs.values())
    assert all(data.startswith(PNG_MAGIC) and len(data) > 1000 for data in found)
    # The CDF grid has a column per level: wider than the two-panel trend figure.
    widths = [int.from_bytes(data[16:20], "big") for data in found]
    assert widths[0] > widths[1]
    for number in ("123.4", "333.7", "61.9", "87.9", "200.0 / 300.0 / 400.0", "21.0 / 35.0 / 59.0", "0.24"):
        assert number in page, number
    assert "server 127.0.0.1:8000" in page and "peer 127.0.0.1:8081" in page


def test_throughput_report_draws_rates_and_the_engines_with_per_request_latencies():
    page, pngs = render(throughput_result())
    assert set(pngs) == {"throughput.png", "latency_cdf.png"}
    assert all(data.startswith(PNG_MAGIC) for data in images(page)) and len(images(page)) == 2
    assert "363.7" in page and "34.8" in page and "10.45x" in page


def test_an_older_result_without_per_request_latencies_still_renders():
    result = serve_result()
    for level in [*result["results"], *result["peer"]["results"]]:
        del level["ttfts_s"], level["itls_s"]
    page, pngs = render(result)
    assert set(pngs) == {"vs_concurrency.png"} and len(images(page)) == 1
    assert "not recorded" in page


def test_helpers():
    assert cdf([3.0, 1.0, 2.0, 4.0]) == ([1.0, 2.0, 3.0, 4.0], [0.25, 0.5, 0.75, 1.0])
    assert kind_of(serve_result()) == "serve" and kind_of(throughput_result()) == "throughput"
    with pytest.raises(ValueError):
        kind_of({"results": 3})
    short = shortened({"a": list(range(100)), "b": ["x"] * 100, "c": [1, 2]})
    assert short["a"][:3] == [0, 1, 2] and short["a"][-1] == "... 80 more in result.json" and len(short["a"]) == 21
    assert short["b"] == ["x"] * 100 and short["c"] == [1, 2]


def test_bench_report_redraws_a_saved_result(tmp_path, capsys):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(serve_result()))
    assert main(["bench", "report", str(saved), "--report", str(tmp_path / "r")]) == 0
    page = (tmp_path / "r" / "index.html").read_text()
    assert len(images(page)) == 2 and "333.7" in page
    assert json.loads((tmp_path / "r" / "result.json").read_text()) == serve_result()
    assert (tmp_path / "r" / "vs_concurrency.png").read_bytes().startswith(PNG_MAGIC)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["bench", "report", str(bad), "--report", str(tmp_path / "x")]) == 2
    assert "cannot read a benchmark result" in capsys.readouterr().err


def test_bench_serve_report_on_fake_servers(tmp_path):
    """The --report hook end to end: per-request latencies are kept and drawn for both servers."""
    with fake_server("ours", 0.0) as (url, _), fake_server("theirs", 0.01) as (peer_url, _):
        argv = ["bench", "serve", "--url", url, "--peer-url", peer_url, "--concurrency", "1,2", "--requests", "2",
                "--prompt-words", "6", "--output-tokens", "3", "--report", str(tmp_path)]
        assert main(argv) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    for level in [*result["results"], *result["peer"]["results"]]:
        assert len(level["ttfts_s"]) == 2 and len(level["itls_s"]) == 4  # 2 requests x (3 chunks - 1 gap)
    assert len(images((tmp_path / "index.html").read_text())) == 2


def test_write_report_makes_the_directory(tmp_path):
    path = write_report(throughput_result(), str(tmp_path / "a" / "b"))
    assert path.endswith("index.html") and (tmp_path / "a" / "b" / "throughput.png").exists()
