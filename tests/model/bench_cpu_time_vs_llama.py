"""tokenmill vs llama-bench by CPU time at 1 thread (not a test), for a machine shared with others:
`PYTHONPATH=src:. python -m tests.model.bench_cpu_time_vs_llama FILE.gguf ... [--llama-cpp DIR]`.

On a loaded machine wall-clock tok/s swing 2-5x from run to run, and llama.cpp's spinning threads
collapse, but the CPU-seconds each engine spends per token stay comparable (both inflated alike by
the others' use of caches and memory). llama-bench's model load and warm-up cancel by differencing
`-r 1` and `-r 4` runs of `-p 512 -n 0` and `-p 0 -n 128` (user + sys of the child); tokenmill's
`LLM(file, num_threads=1)` is timed with getrusage around a 512-token prompt and around 127 decode
steps, best of 3. Prints CPU ms per token and llama.cpp's / tokenmill's (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess

from tokenmill import LLM, SamplingParams
from tokenmill.bench.latency import _prompt
from tokenmill.bench.llama_cpp_peer import find_binary


def llama_cpu(binary: str, model: str, p: int, n: int, r: int) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([binary, "-m", model, "-p", str(p), "-n", str(n), "-t", "1", "-r", str(r), "-o", "json"],
                   capture_output=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def own_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def tokenmill_cpu(model: str) -> tuple[float, float]:
    """(CPU seconds per prompt token of a 512-token prompt, per decode step), best of 3."""
    llm = LLM(model, num_threads=1, kv_cache_tokens=4096)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.vocab_size
    llm.generate({"prompt_token_ids": _prompt(512, vocab, 77)}, one)
    pp, tg = [], []
    for i in range(3):
        llm.reset_prefix_cache()
        c = own_cpu()
        llm.generate({"prompt_token_ids": _prompt(512, vocab, i)}, one)
        pp.append((own_cpu() - c) / 512)
        short = _prompt(8, vocab, 1000 + i)
        c = own_cpu()
        llm.generate({"prompt_token_ids": short}, one)
        first = own_cpu() - c
        llm.reset_prefix_cache()
        c = own_cpu()
        llm.generate({"prompt_token_ids": short}, gen)
        tg.append((own_cpu() - c - first) / 127)
    return min(pp), min(tg)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--llama-cpp", default=None, help="folder of llama-bench (default: the build script's)")
    args = p.parse_args()
    binary = find_binary("llama-bench", args.llama_cpp)
    for model in args.models:
        lb_pp = (llama_cpu(binary, model, 512, 0, 4) - llama_cpu(binary, model, 512, 0, 1)) / (3 * 512)
        lb_tg = (llama_cpu(binary, model, 0, 128, 4) - llama_cpu(binary, model, 0, 128, 1)) / (3 * 128)
        tm_pp, tm_tg = tokenmill_cpu(model)
        print(f"{os.path.basename(model)}: CPU ms/token pp512 tokenmill {tm_pp * 1e3:.3f} llama.cpp {lb_pp * 1e3:.3f}"
              f" -> {lb_pp / tm_pp:.2f}x; tg128 tokenmill {tm_tg * 1e3:.2f} llama.cpp {lb_tg * 1e3:.2f}"
              f" -> {lb_tg / tm_tg:.2f}x; load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
