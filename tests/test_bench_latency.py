"""`tokenmill bench latency` and its llama.cpp peer, without a real llama.cpp: llama-bench is a fake
script that prints canned JSON, so the peer path runs end to end in seconds."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill.bench.llama_cpp_peer import PeerError, find_binary, parse_llama_bench, run_llama_bench
from tokenmill.entrypoints.cli import main
from tokenmill.model.default_model import default_model_path

# Tiny lengths, a small ceilings matmul and one thread (see tests/test_bench_throughput.py for why one).
TINY = ["--prompt-len", "12", "--gen-len", "5", "--repeats", "2", "--kv-cache-tokens", "2048",
        "--ceiling-size", "256", "--num-threads", "1"]

# What llama-bench -p 512 -n 128 -r 2 -o json prints (fields trimmed to the ones a reader would check).
SAMPLE = """[
  {
    "build_commit": "abc1234", "build_number": 1, "model_filename": "m.gguf", "model_type": "llama ?B Q4_1",
    "n_threads": 2, "n_prompt": 512, "n_gen": 0, "n_depth": 0, "test_time": "2026-12-01T00:00:00Z",
    "avg_ns": 1700000000, "stddev_ns": 5000000, "avg_ts": 301.2, "stddev_ts": 0.9,
    "samples_ns": [ 1690000000, 1710000000 ],
    "samples_ts": [ 302.0, 300.4 ]
  },
  {
    "build_commit": "abc1234", "build_number": 1, "model_filename": "m.gguf", "model_type": "llama ?B Q4_1",
    "n_threads": 2, "n_prompt": 0, "n_gen": 128, "n_depth": 0, "test_time": "2026-12-01T00:00:05Z",
    "avg_ns": 1090000000, "stddev_ns": 1000000, "avg_ts": 117.4, "stddev_ts": 0.2,
    "samples_ns": [ 1089000000, 1091000000 ],
    "samples_ts": [ 117.5, 117.3 ]
  }
]
"""


def test_parse_llama_bench_json():
    pp, tg = parse_llama_bench(SAMPLE, 512, 128)
    assert (pp.n_prompt, pp.n_gen, pp.avg_ts, pp.stddev_ts, pp.samples_ts) == (512, 0, 301.2, 0.9, [302.0, 300.4])
    assert (tg.n_prompt, tg.n_gen, tg.avg_ts, tg.n_threads, tg.build_commit) == (0, 128, 117.4, 2, "abc1234")
    with pytest.raises(PeerError, match="no pp256"):
        parse_llama_bench(SAMPLE, 256, 128)
    with pytest.raises(PeerError, match="no JSON"):
        parse_llama_bench("llama_model_load: error", 512, 128)


def test_missing_binary_names_the_flag_and_the_build_script(tmp_path, monkeypatch):
    with pytest.raises(PeerError, match="--llama-cpp") as info:
        find_binary("llama-bench", str(tmp_path))
    assert "build-llama-cpp.sh" in str(info.value)
    monkeypatch.setenv("HOME", str(tmp_path))  # the default folder is under ~/.cache
    with pytest.raises(PeerError, match="tokenmill-peers"):
        find_binary("llama-bench")


def test_binary_lookup_takes_a_checkout_or_the_newest_default_build(tmp_path, monkeypatch):
    checkout = _fake_llama_bench(tmp_path / "src" / "build" / "bin")
    assert find_binary("llama-bench", str(tmp_path / "src")) == str(checkout)
    monkeypatch.setenv("HOME", str(tmp_path))
    for version in ("0.3.9", "0.3.36"):
        _fake_llama_bench(tmp_path / ".cache" / "tokenmill-peers" / f"llama.cpp-{version}" / "build" / "bin")
    assert "llama.cpp-0.3.36" in find_binary("llama-bench")


def _run_fake_llama_bench(tmp_path, body: str) -> None:
    script = tmp_path / "llama-bench"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    run_llama_bench(str(script), "m.gguf", 512, 128, 2, 1)


def test_failed_llama_bench_run_shows_its_error(tmp_path):
    with pytest.raises(PeerError, match="exited with 3:\nerror: failed to load model") as exited:
        _run_fake_llama_bench(tmp_path, "echo 'error: failed to load model' >&2\nexit 3")
    assert "AMX" not in str(exited.value)  # an ordinary failure gets no hint


def test_a_llama_bench_killed_by_a_signal_gets_a_hint_about_amx(tmp_path):
    with pytest.raises(PeerError, match="(?s)exited with -11:.*killed by signal 11.*AMX.*--llama-cpp DIR"):
        _run_fake_llama_bench(tmp_path, "kill -SEGV $$")


def test_end_to_end_on_tiny_model(tmp_path, capsys):
    folder = make_tiny_model(tmp_path, "llama")
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", *TINY, "--model", str(folder), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    s = report["settings"]
    assert s["threads"] == 1 and {"git_commit", "load_average", "load_average_end", "date"} <= set(s)
    assert set(report["results"]) == {"tokenmill"} and "ratios" not in report
    ours = report["results"]["tokenmill"]
    assert ours["errors"] == []
    for test in ("pp", "tg"):
        assert len(ours[test]["runs"]) == 2 and ours[test]["tokens_per_s"] > 0
    assert ours["pp"]["fraction_of_ceiling"] > 0
    # a folder has no file bytes to put decode against
    assert report["model"]["token_weight_bytes"] is None and "gb_per_s" not in ours["tg"]
    printed = capsys.readouterr().out
    assert "pp12" in printed and "tg5" in printed and "MB of weights a token" not in printed


def test_peer_needs_a_gguf_and_a_binary(tmp_path, capsys):
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False)
    assert main(["bench", "latency", *TINY, "--model", str(folder), "--peer", "llama.cpp"]) == 2
    assert "needs a GGUF file" in capsys.readouterr().err
    # Checked before the model loads: the bundled GGUF is never read here.
    assert main(["bench", "latency", *TINY, "--peer", "llama.cpp", "--llama-cpp", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--llama-cpp" in err and "build-llama-cpp.sh" in err


@pytest.mark.slow  # loads the bundled GGUF (~10 s a round): llama-bench only takes GGUF files
@pytest.mark.parametrize("rounds", [1, 3])
def test_end_to_end_with_fake_llama_bench(tmp_path, capsys, rounds):
    bin_dir = tmp_path / "bin"
    _fake_llama_bench(bin_dir, log=tmp_path / "argv.json")
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", *TINY, "--no-warmup", "--peer", "llama.cpp", "--llama-cpp", str(bin_dir),
            "--json", str(out), "--rounds", str(rounds)]
    assert main(argv) == 0
    calls = [json.loads(line) for line in (tmp_path / "argv.json").read_text().splitlines()]
    assert calls == [["-m", default_model_path(), "-p", "12", "-n", "5", "-t", "1", "-r", "2", "-o", "json"]] * rounds
    report = json.loads(out.read_text())
    peer = report["results"]["llama.cpp"]
    assert peer["pp"]["tokens_per_s"] == pytest.approx(300.0) and peer["tg"]["tokens_per_s"] == pytest.approx(100.0)
    assert peer["threads"] == 1 and peer["build_commit"] == "fake"
    ours = report["results"]["tokenmill"]
    assert len(ours["pp"]["runs"]) == len(peer["tg"]["runs"]) == 2 * rounds  # every round's runs
    printed = capsys.readouterr().out
    assert "tokenmill / llama.cpp: pp12" in printed
    # decode against the bytes a token reads: the bundled file's, one figure for both engines
    token_bytes, ceiling = report["model"]["token_weight_bytes"], report["read_ceiling_gb_per_s"]
    assert 0.9 * os.path.getsize(default_model_path()) < token_bytes < os.path.getsize(default_model_path())
    for engine in (ours, peer):
        assert engine["tg"]["gb_per_s"] == pytest.approx(token_bytes * engine["tg"]["tokens_per_s"] / 1e9)
        assert engine["tg"]["fraction_of_read_ceiling"] == pytest.approx(engine["tg"]["gb_per_s"] / ceiling)
    assert f"tg5 reads {token_bytes / 1e6:.1f} MB of weights a token" in printed
    if rounds == 1:
        assert "round_ratios" not in report and "one run" in printed
        assert report["ratios"]["pp"] == pytest.approx(ours["pp"]["tokens_per_s"] / 300.0)
        assert report["ratios"]["tg"] == pytest.approx(ours["tg"]["tokens_per_s"] / 100.0)
        return
    # the ratio is the median of the rounds' own ratios, each from that round's medians
    per_round = report["round_ratios"]
    assert len(per_round) == rounds and "median of 3 rounds" in printed
    for test, peer_rate in (("pp", 300.0), ("tg", 100.0)):
        ratios = sorted(r[test] for r in per_round)
        assert report["ratios"][test] == pytest.approx(ratios[1])
        runs = ours[test]["runs"]  # each round's 2 runs, in order: the round's median is their mean
        assert ratios == pytest.approx(sorted((runs[2 * i] + runs[2 * i + 1]) / 2 / peer_rate for i in range(rounds)))


def _fake_llama_bench(folder, log=None):
    """An executable `llama-bench` that records its argv and answers like the real one (-o json)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llama-bench"
    path.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
if {str(log) if log else None!r}:
    open({str(log)!r}, "a").write(json.dumps(args) + "\\n")
opt = dict(zip(args[::2], args[1::2]))
p, n, t, r = (int(opt[k]) for k in ("-p", "-n", "-t", "-r"))
def entry(n_prompt, n_gen, ts):
    return {{"build_commit": "fake", "model_type": "fake", "n_threads": t, "n_prompt": n_prompt,
             "n_gen": n_gen, "n_depth": 0, "avg_ts": ts, "stddev_ts": 1.0,
             "samples_ts": [ts - 1.0, ts + 1.0] if r > 1 else [ts]}}
print(json.dumps([entry(p, 0, 300.0), entry(0, n, 100.0)], indent=2))
""")
    os.chmod(path, 0o755)
    return path


def test_emulated_bf16_is_measured_small_and_prompts_compare_with_fp32(monkeypatch):
    # Where bf16 GEMMs are emulated (no AVX512-BF16 / AMX, or TOKENMILL_CPU_ISA=avx2), fast mode's
    # prompts run fp32 GEMMs: their ceiling is fp32's, and bf16's 2048 matmul (a minute a call
    # there) is measured at a small size for the record.
    import torch

    from tokenmill.bench import common
    from tokenmill.model.kernels import cpu_isa

    sizes: list[tuple[torch.dtype, int]] = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: (sizes.append((a.dtype, a.shape[0])), real_mm(a, b))[1])
    monkeypatch.setattr(cpu_isa, "bf16_gemm_native", lambda: False)
    ceilings = common.matmul_ceilings(1, size=384, seconds=0.0)
    assert common.fast_gemm_dtype() == "fp32" and set(ceilings) == {"fp32", "bf16"}
    assert {s for d, s in sizes if d == torch.bfloat16} == {common.EMULATED_BF16_SIZE}
    assert {s for d, s in sizes if d == torch.float32} == {384}
    monkeypatch.setattr(cpu_isa, "bf16_gemm_native", lambda: True)
    sizes.clear()
    common.matmul_ceilings(1, size=384, seconds=0.0)
    assert common.fast_gemm_dtype() == "bf16" and {s for _, s in sizes} == {384}
