"""llama.cpp as a benchmark peer: find its binaries, run llama-bench, read its JSON.

llama.cpp is what CPU users pick, so tokenmill's one-user numbers are judged against llama-bench's
pp<N> (prompt processing) and tg<N> (batch-1 decode) on the same GGUF and thread count
(docs/benchmarks.md). The binaries are not part of the project: ../shared/tools/build-llama-cpp.sh
builds them under ~/.cache/tokenmill-peers, or `--llama-cpp DIR` names another build.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
from dataclasses import dataclass, field

from tokenmill.errors import TokenmillError

DEFAULT_ROOT = "~/.cache/tokenmill-peers"
BUILD_SCRIPT = "../shared/tools/build-llama-cpp.sh"


class PeerError(TokenmillError):
    """A peer that cannot be run: missing binary, failed run, output we cannot read."""


@dataclass(frozen=True)
class LlamaBenchTest:
    """One llama-bench test (pp<N> or tg<N>): its mean rate and each repeat's."""

    n_prompt: int
    n_gen: int
    avg_ts: float
    stddev_ts: float
    samples_ts: list[float] = field(default_factory=list)
    n_threads: int | None = None
    build_commit: str | None = None
    model_type: str | None = None


def find_binary(name: str, directory: str | None = None) -> str:
    """The path of llama.cpp's `name` (e.g. "llama-bench") in `directory` or the default build folder.

    `directory` may be the folder of the binaries or a llama.cpp checkout (then build/bin under it).
    Raises PeerError naming the flag and the build script when there is none.
    """
    if directory is not None:
        base = os.path.abspath(os.path.expanduser(directory))
        candidates = [base, os.path.join(base, "build", "bin")]
        where = f"--llama-cpp {directory}"
    else:
        # Newest version first: the build script puts each version in its own llama.cpp-<version>.
        pattern = os.path.join(os.path.expanduser(DEFAULT_ROOT), "llama.cpp-*", "build", "bin")
        candidates = sorted(glob.glob(pattern), key=_version_key, reverse=True)
        where = f"{DEFAULT_ROOT}/llama.cpp-*/build/bin"
    for folder in candidates:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise PeerError(
        f"no {name} executable in {where}; build llama.cpp with {BUILD_SCRIPT} (it prints the folder "
        f"of the binaries) or pass --llama-cpp DIR"
    )


def _version_key(path: str) -> tuple[int, ...]:
    # "llama.cpp-0.3.36" must sort after "llama.cpp-0.3.9": compare the numbers, not the text.
    match = re.search(r"llama\.cpp-([0-9.]+)", path)
    return tuple(int(p) for p in match.group(1).split(".") if p) if match else ()


def run_llama_bench(
    binary: str, model: str, prompt_len: int, gen_len: int, threads: int, repeats: int
) -> tuple[LlamaBenchTest, LlamaBenchTest, list[dict]]:
    """Runs llama-bench's pp<prompt_len> and tg<gen_len> tests; returns them and its raw entries."""
    cmd = [binary, "-m", model, "-p", str(prompt_len), "-n", str(gen_len), "-t", str(threads),
           "-r", str(repeats), "-o", "json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise PeerError(f"cannot run {binary}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-10:])
        raise PeerError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}{_crash_hint(proc.returncode)}")
    entries = _load_entries(proc.stdout)
    pp, tg = parse_llama_bench(entries, prompt_len, gen_len)
    return pp, tg, entries


def _crash_hint(returncode: int) -> str:
    """What to try when llama-bench died of a signal (a negative return code)."""
    if returncode >= 0:
        return ""
    return (f"\nllama-bench was killed by signal {-returncode}. On CPUs with AMX, a native build of this "
            "llama.cpp crashes in its AMX matmul (ggml-org/llama.cpp#20824: the tile configuration on the "
            "stack is optimized away; docs/benchmarks.md says how the peer was patched); pass --llama-cpp "
            "DIR for a build with that fix, or one built with -DGGML_NATIVE=OFF and AVX512 flags.")


def _load_entries(text: str) -> list[dict]:
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise PeerError(f"llama-bench printed no JSON ({exc}); its output began: {text[:200]!r}") from exc
    if not isinstance(entries, list):
        raise PeerError(f"llama-bench JSON is not a list of tests: {text[:200]!r}")
    return entries


def parse_llama_bench(
    entries: list[dict] | str, prompt_len: int, gen_len: int
) -> tuple[LlamaBenchTest, LlamaBenchTest]:
    """The pp<prompt_len> and tg<gen_len> tests of llama-bench's `-o json` output (text or parsed).

    llama-bench prints one entry per test: pp has n_gen 0, tg has n_prompt 0. Entries at a KV depth
    (`-d`) measure something else and are skipped.
    """
    if isinstance(entries, str):
        entries = _load_entries(entries)
    found: dict[tuple[int, int], LlamaBenchTest] = {}
    for e in entries:
        try:
            if e.get("n_depth", 0):
                continue
            test = LlamaBenchTest(
                n_prompt=int(e["n_prompt"]), n_gen=int(e["n_gen"]), avg_ts=float(e["avg_ts"]),
                stddev_ts=float(e["stddev_ts"]), samples_ts=[float(x) for x in e.get("samples_ts") or []],
                n_threads=e.get("n_threads"), build_commit=e.get("build_commit"), model_type=e.get("model_type"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PeerError(f"unexpected llama-bench entry ({exc!r}): {str(e)[:200]}") from exc
        found[(test.n_prompt, test.n_gen)] = test
    missing = [name for name, key in ((f"pp{prompt_len}", (prompt_len, 0)), (f"tg{gen_len}", (0, gen_len)))
               if key not in found]
    if missing:
        raise PeerError(f"llama-bench output has no {' or '.join(missing)} test; it has {sorted(found)}")
    return found[(prompt_len, 0)], found[(0, gen_len)]
