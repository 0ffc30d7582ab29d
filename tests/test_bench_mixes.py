"""`tokenmill bench mixes` without a real llama.cpp: llama-quantize is a fake script that checks its
argv and writes a file, so the command's naming, skipping and error paths run in a second."""

from __future__ import annotations

import os
import sys

from tokenmill.entrypoints.cli import main


def _fake_quantize(folder, log, fail_on=None):
    """An executable `llama-quantize` that appends its argv to `log` and writes "<type>" to its output."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llama-quantize"
    path.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(repr(args) + "\\n")
if args[3] == {fail_on!r}:
    print("llama_model_quantize: failed to quantize: unsupported", file=sys.stderr)
    sys.exit(1)
open(args[2], "w").write(args[3])
""")
    os.chmod(path, 0o755)
    return path


def _calls(log) -> list[list[str]]:
    return [eval(line) for line in log.read_text().splitlines()]  # noqa: S307 - our own repr() lines


def test_makes_each_mix_once_from_the_source(tmp_path, capsys):
    source = tmp_path / "Model-135M.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    log, out = tmp_path / "argv.log", tmp_path / "mixes"
    _fake_quantize(tmp_path / "bin", log)
    argv = ["bench", "mixes", "--source", str(source), "--out", str(out), "--llama-cpp", str(tmp_path / "bin"),
            "--mix", "Q4_K_M", "IQ4_XS", "Q1_0", "--threads", "3"]
    assert main(argv) == 0
    made = {p.name: p.read_text() for p in out.iterdir()}
    assert made == {"Model-135M-Q4_K_M.gguf": "Q4_K_M", "Model-135M-IQ4_XS.gguf": "IQ4_XS",
                    "Model-135M-Q1_0.gguf": "Q1_0"}  # no .partial left
    first = _calls(log)[0]
    assert first == ["--allow-requantize", str(source), str(out / "Model-135M-Q4_K_M.gguf") + ".partial", "Q4_K_M", "3"]
    # A second run keeps the files it finds; --force remakes them.
    assert main(argv) == 0 and len(_calls(log)) == 3
    assert "exists" in capsys.readouterr().out
    assert main([*argv, "--force"]) == 0 and len(_calls(log)) == 6


def test_failed_quantize_names_the_mix_and_leaves_no_file(tmp_path, capsys):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    log, out = tmp_path / "argv.log", tmp_path / "mixes"
    _fake_quantize(tmp_path / "bin", log, fail_on="Q3_K_M")
    argv = ["bench", "mixes", "--source", str(source), "--out", str(out), "--llama-cpp", str(tmp_path / "bin"),
            "--mix", "Q3_K_M"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Q3_K_M" in err and "unsupported" in err
    assert list(out.iterdir()) == []


def test_missing_llama_quantize_names_the_build_script(tmp_path, capsys):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    assert main(["bench", "mixes", "--source", str(source), "--llama-cpp", str(tmp_path)]) == 2
    assert "build-llama-cpp.sh" in capsys.readouterr().err
