"""`tokenmill bench decode-step`: reachable from the bench table, times a tiny model's fused step per
barrier kind with the barrier counts, and names a bad kind instead of raising."""

from __future__ import annotations

import json

import pytest

from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.entrypoints.cli import main
from tokenmill.model.kernels import decode_step


def test_unknown_barrier_kind_is_a_usage_error(capsys):
    assert main(["bench", "decode-step", "--model", "unused", "--barriers", "omp,spinny"]) == 2
    assert "spinny" in capsys.readouterr().err


@pytest.mark.skipif(not decode_step.available(), reason="needs the C++ kernels and AVX512-VNNI")
def test_times_the_step_per_barrier_kind(tmp_path, capsys):
    folder = make_tiny_model(tmp_path, "llama", tokenizer=False, hidden_size=128, intermediate_size=256)
    gguf = write_tiny_gguf(folder, tmp_path / "tiny.gguf", quant="Q8_0")
    out = tmp_path / "step.json"
    argv = ["bench", "decode-step", "--model", str(gguf), "--context", "40", "--steps", "3", "--blocks", "2",
            "--barriers", "omp,spin:5", "--barrier-stats", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())["result"]
    assert result["cpu_ms_1_thread"]["best"] > 0
    assert sorted(result["threads"]) == ["omp", "spin:5"]
    for kind in ("omp", "spin:5"):
        r = result["threads"][kind]
        assert 0 < r["wall_ms"]["best"] <= r["wall_ms"]["median"]
        assert r["barriers"]["per_step"] == 5 * 2  # one row (decode_row_phases.h): 5 a layer, 2 layers
        assert 0 <= r["barriers"]["after_last_arrival_share"] <= r["barriers"]["wait_share"] <= 1
    assert "spin:5 barriers" in capsys.readouterr().out
