from __future__ import annotations

import json

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill.bench.common import (
    FIRST_ORDINARY_TOKEN,
    ModelFlops,
    RunResult,
    make_workload,
    model_flops,
    summarize,
)
from tokenmill.entrypoints.cli import main
from tokenmill.model.config import ModelConfig

# A small ceilings matmul and a tiny workload keep each end-to-end run to seconds. One thread: on a
# shared 2-core machine two OpenMP threads wait a scheduler slice at every barrier when another
# process holds a core, turning a 1 s run into 30 s.
TINY = ["--requests", "3", "--min-prompt", "8", "--max-prompt", "16", "--min-output", "4",
        "--max-output", "8", "--kv-cache-tokens", "2048", "--ceiling-size", "256", "--num-threads", "1"]
RESULT_KEYS = {"requests", "prompt_tokens", "output_tokens", "seconds", "output_tokens_per_s",
               "total_tokens_per_s", "achieved_gflop_per_s", "ceiling_gflop_per_s", "fraction_of_ceiling",
               "spread", "errors", "runs"}


def test_workload_is_deterministic_and_in_bounds():
    a = make_workload(50, (5, 9), (2, 4), vocab_size=1000, seed=7)
    assert a == make_workload(50, (5, 9), (2, 4), vocab_size=1000, seed=7)
    assert a != make_workload(50, (5, 9), (2, 4), vocab_size=1000, seed=8)
    assert len(a) == 50
    assert {len(r.prompt_token_ids) for r in a} <= set(range(5, 10))
    assert {r.output_len for r in a} == {2, 3, 4}  # 50 draws of 3 values: all of them, ends included
    ids = [t for r in a for t in r.prompt_token_ids]
    assert min(ids) >= FIRST_ORDINARY_TOKEN and max(ids) < 1000


def test_workload_rejects_bad_ranges():
    with pytest.raises(ValueError):
        make_workload(1, (9, 5), (2, 4), vocab_size=1000, seed=0)
    with pytest.raises(ValueError):
        make_workload(1, (5, 9), (2, 4), vocab_size=50, seed=0)


def test_flops_count_smollm2_like_the_guide():
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         max_position_embeddings=8192, tie_word_embeddings=True)
    flops = model_flops(config)
    # 134.5M parameters, of which 28.3M embeddings; the tied lm_head uses them once more.
    assert flops.body_params == 30 * (576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536)
    assert flops.head_params == 49152 * 576
    assert flops.params_per_token == pytest.approx(134.5e6, rel=0.01)
    # Two requests of 10 prompt + 5 output: 2 * 14 layer positions, 10 lm_head rows.
    assert flops.run_flops(20, 10, 2) == 2 * (flops.body_params * 28 + flops.head_params * 10)


def test_flops_count_a_moe_token_at_its_routed_experts():
    from tokenmill.model.moe_config import MoEConfig

    moe = MoEConfig(num_experts=32, top_k=4, expert_intermediate_size=512, shared_expert_intermediate_size=256)
    config = ModelConfig(architecture="qwen2_moe", vocab_size=1000, hidden_size=1024, intermediate_size=2048,
                         num_layers=2, num_heads=16, num_kv_heads=4, head_dim=64,
                         max_position_embeddings=4096, tie_word_embeddings=True, moe=moe)
    attention = 1024 * 1024 * 2 + 2 * 1024 * 256
    routed = 4 * 3 * 1024 * 512  # k of the 32 experts, not all of them
    router_and_shared = 32 * 1024 + 3 * 1024 * 256 + 1024
    assert model_flops(config).body_params == 2 * (attention + routed + router_and_shared)


def test_summary_median_and_spread():
    runs = [RunResult(s, 2, 20, 10) for s in (1.0, 2.0, 4.0)]
    s = summarize(runs, ModelFlops(body_params=1_000_000, head_params=0), ceiling_gflops=1.0)
    assert s["seconds"] == 2.0 and s["output_tokens_per_s"] == 5.0
    assert s["spread"] == pytest.approx((10.0 - 2.5) / 5.0)
    assert s["fraction_of_ceiling"] == pytest.approx(2 * 1e6 * 28 / 1e9 / 2.0)


def _check_report(path, engines):
    report = json.loads(path.read_text())
    assert set(report["results"]) == set(engines)
    assert {"threads", "precision", "git_commit", "date", "load_average"} <= set(report["settings"])
    assert report["settings"]["threads"] == 1
    assert set(report["ceilings_gflop_per_s"]) == {"fp32", "bf16"}
    requested = report["settings"]["args"]
    for result in report["results"].values():
        assert set(result) >= RESULT_KEYS
        assert result["errors"] == [] and result["requests"] == requested["requests"]
    return report


def test_end_to_end_on_bundled_model(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "throughput", *TINY, "--json", str(out), "--report", str(tmp_path / "report")]) == 0
    report = _check_report(out, ["tokenmill"])
    expected = make_workload(3, (8, 16), (4, 8), vocab_size=49152, seed=0)
    result = report["results"]["tokenmill"]
    assert result["output_tokens"] == sum(r.output_len for r in expected)
    assert result["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in expected)
    # Per-request latencies for the report's CDFs (every request made more than one token).
    ttfts, itls = result["per_request"]["ttft_s"], result["per_request"]["itl_s"]
    assert len(ttfts) == len(itls) == 3 and all(t > 0 for t in ttfts) and all(x > 0 for x in itls)
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 2 and f"{result['output_tokens_per_s']:.1f}" in page


def test_end_to_end_with_transformers_peer_on_tiny_model(tmp_path, capsys):
    folder = make_tiny_model(tmp_path, "llama")
    out = tmp_path / "bench.json"
    argv = ["bench", "throughput", *TINY, "--model", str(folder), "--peer", "transformers",
            "--peer-batch-size", "2", "--repeats", "2", "--no-warmup", "--json", str(out)]
    assert main(argv) == 0
    report = _check_report(out, ["tokenmill", "transformers"])
    # The peer pads its batch to the longest request but only the requested lengths count.
    expected = sum(r.output_len for r in make_workload(3, (8, 16), (4, 8), vocab_size=49152, seed=0))
    assert all(r["output_tokens"] == expected for r in report["results"].values())
    assert all(len(r["runs"]) == 2 for r in report["results"].values())
    assert report["ratio_output_tokens_per_s"] > 0
    printed = capsys.readouterr()
    assert "tokenmill / transformers" in printed.out
    assert "transformers: 100%" in printed.err and "generating: 100%" in printed.err  # progress, on stderr
