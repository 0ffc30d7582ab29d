"""Building the C++ kernels ahead of their first use (`make kernels`: model/kernels/cpp_build.py): every
csrc/*.cpp gets a library in the cache, a cached one is not built again, and a compiler that fails
leaves the engine its PyTorch fallback, with the exit status still 0."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

from tokenmill.model.kernels import cpp_build

LOG = logging.getLogger("test_cpp_build")
NAMES = sorted(p.stem for p in cpp_build.CSRC.glob("*.cpp"))


def fake_compiler(tmp_path: Path, body: str) -> str:
    """A stand-in for c++: a script that runs `body` with the output path in $OUT."""
    script = tmp_path / "fake-cxx"
    script.write_text('#!/bin/sh\nOUT=""\nwhile [ $# -gt 0 ]; do [ "$1" = "-o" ] && OUT="$2"; shift; done\n' + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_every_kernel_is_built_once_and_then_found_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    compiler = fake_compiler(tmp_path, 'echo built > "$OUT"\necho x >> "' + str(tmp_path / "calls") + '"\n')
    monkeypatch.setenv("CXX", compiler)
    assert cpp_build.build_all(3, LOG) == {name: True for name in NAMES}
    for name in NAMES:
        assert cpp_build.library_path(name, compiler).read_text() == "built\n"
    assert len((tmp_path / "calls").read_text().split()) == len(NAMES)
    assert cpp_build.build_all(3, LOG) == {name: True for name in NAMES}
    assert len((tmp_path / "calls").read_text().split()) == len(NAMES)  # cached: no second build


def test_a_failing_compiler_leaves_the_pytorch_path_and_exit_status_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, "echo 'error: no such thing' >&2\nexit 1\n"))
    assert cpp_build.main(["--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert f"0 of {len(NAMES)} ready" in out and "run in PyTorch" in out
    logs = list((tmp_path / "cache" / "kernels").glob("*/build.log"))
    assert len(logs) == len(NAMES) and "no such thing" in logs[0].read_text()

