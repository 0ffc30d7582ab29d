"""`tokenmill bench load-memory`: reachable from the bench table, one row per load stage of the bundled
model with the memory /proc reports, and issue 23's bound computed from the file."""

from __future__ import annotations

import json

from tokenmill.bench.load_memory import target_mb
from tokenmill.entrypoints.cli import main


def test_reports_each_stage_against_the_bound(tmp_path, capsys):
    out = tmp_path / "mem.json"
    assert main(["bench", "load-memory", "--generate-tokens", "2", "--num-threads", "1", "--json", str(out)]) == 0
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
    text = capsys.readouterr().out
    assert "target 1.1 x file + 150 MB" in text and ("not met" in text or " met " in text)
