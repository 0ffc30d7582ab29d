"""A 512-token prompt's CPU time at 1 thread per `prompt_gemm` setting (not a test), alternating the
settings in one process so that a loaded machine slows them alike:
`PYTHONPATH=src:. python -m tests.model.bench_prompt_gemm FILE.gguf ... [--settings vnni auto] [--rounds 3]`
(`--settings default` passes no setting: the same command times an older tree, PYTHONPATH=OLD/src:.).

Each setting gets its own `LLM(file, num_threads=1, prompt_gemm=...)`; a round times one fresh
512-token prompt (prefix cache reset, one generated token) on each in turn, by getrusage. Prints the
best and the median CPU ms per prompt token and the ratio to the first setting (docs/benchmarks.md,
"GGUF mixes: per-format prompt path and speed").
"""

from __future__ import annotations

import argparse
import os
import statistics

from tests.model.bench_cpu_time_vs_llama import own_cpu
from tokenmill import LLM, SamplingParams
from tokenmill.bench.latency import _prompt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    # "default": no prompt_gemm argument at all (also runs on a tree from before the setting existed)
    p.add_argument("--settings", nargs="+", default=["vnni", "auto"], choices=["default", "auto", "vnni", "bf16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=512)
    args = p.parse_args()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for model in args.models:
        llms = {s: LLM(model, num_threads=1, kv_cache_tokens=4096, **({} if s == "default" else {"prompt_gemm": s}))
                for s in args.settings}
        vocab = next(iter(llms.values())).engine.vocab_size
        for llm in llms.values():  # warm-up: kernels loaded, first pages touched
            llm.generate({"prompt_token_ids": _prompt(args.prompt_len, vocab, 77)}, one)
        times: dict[str, list[float]] = {s: [] for s in args.settings}
        for r in range(args.rounds):
            for s, llm in llms.items():
                llm.reset_prefix_cache()
                c = own_cpu()
                llm.generate({"prompt_token_ids": _prompt(args.prompt_len, vocab, r)}, one)
                times[s].append((own_cpu() - c) / args.prompt_len * 1e3)
        first = min(times[args.settings[0]])
        cells = [f"{s} best {min(t):.3f} median {statistics.median(t):.3f} ms/token ({first / min(t):.2f}x)"
                 for s, t in times.items()]
        print(f"{os.path.basename(model)}: pp{args.prompt_len} CPU, 1 thread: {'; '.join(cells)}; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        del llms


if __name__ == "__main__":
    main()
