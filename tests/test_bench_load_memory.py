"""`tokenmill bench load-memory`: reachable from the bench table, one row per load stage of the bundled
model with the memory /proc reports, and issue 23's bound computed from the file.

Run as the command, in a process of its own: what it measures is a fresh process's memory (in the
suite's process the file's pages and the imports are long resident, and the stages barely move)."""

from __future__ import annotations

import json
import subprocess

from tests.server.server_process import tokenmill_command
from tokenmill.bench.load_memory import target_mb


def test_reports_each_stage_against_the_bound(tmp_path):
    out = tmp_path / "mem.json"
    run = subprocess.run([*tokenmill_command(), "bench", "load-memory", "--generate-tokens", "2", "--num-threads", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    stages = report["stages"]
    assert [s["stage"] for s in stages][:2] == ["imports", "engine core (weights, runner)"]
    assert stages[-1]["stage"] == "generated 2 tokens" and len(stages) == 5
    for s in stages:
        assert 0 < s["RssAnon"] <= s["VmRSS"] <= s["VmHWM"]
    peaks = [s["VmHWM"] for s in stages]
    assert peaks == sorted(peaks)  # a high-water mark never falls
    assert stages[1]["VmRSS"] - stages[0]["VmRSS"] > 0.5 * report["weights_mb"]  # the weights became resident
    assert report["target_mb"] == target_mb(int(report["file_mb"] * 2**20)) > report["file_mb"]
    assert report["ratio_to_target"] == stages[-1]["VmRSS"] / report["target_mb"]
    assert report["growth_mb"] == stages[-1]["VmRSS"] - stages[0]["VmRSS"]  # over the imports, as issue 22 counts
    assert report["growth_to_target"] == report["growth_mb"] / report["target_mb"]
    assert report["transformers_imported"] is False  # the tokenizer came from the export child / its cache
    assert stages[2]["stage"] == "tokenizer" and stages[2]["s"] > 0
    text = run.stdout
    verdict = "met" if report["growth_mb"] <= report["target_mb"] else "not met"
    assert f"target 1.1 x file + 150 MB = {report['target_mb']:.0f} MB of growth over the imports: {verdict} (" in text
