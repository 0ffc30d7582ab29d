"""`LLM(file)`'s resident memory against issue 22's bound (not a test), one process per file:
`PYTHONPATH=src:. python -m tests.model.bench_llm_rss [FILE.gguf] [--precision fast]`.

RSS growth (VmRSS, MB of 10^6 bytes) from after `import torch, tokenmill` to after `LLM(file)` and one 16-token greedy
request, the peak growth (ru_maxrss), and the model's weight bytes, next to 1.3 x the file + 150 MB
(the bundled model's target) and 1.1 x the file + 150 MB (the mixes'). Default file: the bundled
model (docs/benchmarks.md, "GGUF mixes: memory and quality").
"""

from __future__ import annotations

import argparse
import os
import resource

import torch  # noqa: F401  (counted in the baseline, as the server imports it before loading)

import tokenmill  # noqa: F401
from tokenmill import LLM, SamplingParams
from tokenmill.model.default_model import default_model_path


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--precision", default="fast")
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args()
    path = args.model or default_model_path()
    base, peak_base = rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6
    llm = LLM(path, precision=args.precision, num_threads=args.num_threads)
    loaded = rss_mb() - base
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    growth = rss_mb() - base
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6 - peak_base
    file_mb = os.path.getsize(path) / 1e6
    weights = llm.engine.runner.model.weight_bytes() / 1e6
    print(f"{os.path.basename(path)}: file {file_mb:.1f} MB, weights {weights:.1f} MB; RSS growth after LLM() "
          f"{loaded:.0f} MB, after one request {growth:.0f} MB (1.3 x file + 150: {1.3 * file_mb + 150:.0f}; "
          f"1.1 x file + 150: {1.1 * file_mb + 150:.0f}); peak growth {peak:.0f} MB; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
