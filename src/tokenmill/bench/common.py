"""Pieces every `tokenmill bench` command shares: seeded workloads, FLOP accounting, machine ceilings,
run settings and the results table.

Speed on these shared machines is only meaningful as a ratio measured in the same run, so each
benchmark re-measures the matmul ceilings next to the engines it times (docs/benchmarks.md).
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.model import huge_pages
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import expected_shapes

# Ids below this are control tokens in SmolLM2's vocabulary (< 17) and in the other vocabularies we
# load; random prompts of special tokens would exercise nothing a real prompt does.
FIRST_ORDINARY_TOKEN = 100
# Recorded with every result: the thread settings, and the instruction-set caps (an AVX-512 machine
# run as an AVX2 one: docs/benchmarks.md, "CPUs without AVX-512").
RECORDED_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "KMP_BLOCKTIME",
              "TOKENMILL_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
              "TOKENMILL_HUGE_PAGES")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """N requests with lengths uniform in the inclusive ranges and random ordinary token ids.

    `random.Random` rather than torch/numpy generators: its sequence for a seed is fixed across
    versions and platforms, so every engine and every later run sees exactly the same requests.
    """
    (p_lo, p_hi), (o_lo, o_hi) = prompt_len, output_len
    if not 1 <= p_lo <= p_hi or not 1 <= o_lo <= o_hi:
        raise ValueError(f"bad length ranges: prompt {prompt_len}, output {output_len}")
    if vocab_size <= FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocabulary of {vocab_size} has no ids >= {FIRST_ORDINARY_TOKEN}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        p, o = rng.randint(p_lo, p_hi), rng.randint(o_lo, o_hi)
        ids = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(p)]
        requests.append(BenchRequest(ids, o))
    return requests


# ---- FLOP accounting ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFlops:
    body_params: int  # every matmul weight of the layers (embedding lookup is a gather, not FLOPs)
    head_params: int  # lm_head (tied or not: the same matmul either way)

    @property
    def params_per_token(self) -> int:
        return self.body_params + self.head_params

    def run_flops(self, prompt_tokens: int, output_tokens: int, num_requests: int) -> float:
        """Useful FLOPs of a run, attention's QK^T/PV excluded (~10% at 400 tokens of context here).

        A request runs the layers on prompt + output - 1 positions (the last sampled token is never
        fed back) and the lm_head only where a token is sampled: one row per output token. Charging
        the lm_head on every prompt position would credit work neither engine does (~13% too much
        FLOPs on the offline workload).
        """
        positions = prompt_tokens + output_tokens - num_requests
        return 2.0 * (self.body_params * positions + self.head_params * output_tokens)


def model_flops(config: ModelConfig) -> ModelFlops:
    """The matmul weights a token multiplies: a MoE layer's routed experts at top_k / num_experts (a
    token runs k of them; counting all of them credited the MoE's prompts with 8x the work), its
    router and shared expert whole."""
    shapes = expected_shapes(config)
    body = 0.0
    routed = config.moe.top_k / config.moe.num_experts if config.moe is not None else 1.0
    for name, shape in shapes.items():
        # Norm weights are element-wise work; the 2-D layer tensors are the matmuls.
        if name.startswith("model.layers.") and len(shape) == 2:
            body += shape[0] * shape[1] * (routed if ".experts." in name else 1.0)
    return ModelFlops(body_params=round(body), head_params=config.vocab_size * config.hidden_size)


# The bf16 ceiling's matmul size where bf16 GEMMs are emulated (no AVX512-BF16 / AMX, or capped by
# TOKENMILL_CPU_ISA): at ~0.3-35 GFLOP/s a 2048 one took a minute a call, four calls a benchmark.
EMULATED_BF16_SIZE = 256


def fast_gemm_dtype() -> str:
    """The dtype of fast mode's dense prompt GEMMs here ("bf16" where native, else "fp32"): the
    ceiling a fast-mode prompt is compared with."""
    from tokenmill.model.kernels import cpu_isa

    return "bf16" if cpu_isa.bf16_gemm_native() else "fp32"


def matmul_ceilings(threads: int, size: int = 2048, seconds: float = 0.5) -> dict[str, float]:
    """Best GFLOP/s of a square fp32 and bf16 matmul at `threads` threads (bf16 at EMULATED_BF16_SIZE
    where this CPU emulates it: a figure for the record, not a ceiling any path runs at).

    Best-of rather than mean: the ceiling is what the hardware can do, and other processes on a
    shared machine only ever make a sample slower.
    """
    torch.set_num_threads(threads)
    result = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if name == "bf16" and fast_gemm_dtype() != "bf16":
            size = min(size, EMULATED_BF16_SIZE)
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        torch.mm(a, b)  # first call pays oneDNN's kernel selection
        result[name] = 2.0 * size**3 / best_seconds(functools.partial(torch.mm, a, b), seconds) / 1e9
    return result


def best_seconds(work, seconds: float) -> float:
    """The shortest of at least 3 timed calls of `work`, more (up to 50) while `seconds` last: a
    machine's ceiling is its best, since other processes only ever make a sample slower."""
    best, deadline, reps = float("inf"), time.perf_counter() + seconds, 0
    while reps < 3 or (time.perf_counter() < deadline and reps < 50):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
        reps += 1
    return best


# ---- one timed run and its summary -------------------------------------------------------------
@dataclass
class RunResult:
    seconds: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # useful output: what the requests asked for and got
    errors: list[str] = field(default_factory=list)


def summarize(runs: Sequence[RunResult], flops: ModelFlops, ceiling_gflops: float) -> dict:
    """Median and spread over repeats of the rates a reader compares; the raw runs ride along."""
    first = runs[0]
    gflop = flops.run_flops(first.prompt_tokens, first.output_tokens, first.num_requests) / 1e9
    secs = [r.seconds for r in runs]
    out_tps = [r.output_tokens / s for r, s in zip(runs, secs)]
    median_s = statistics.median(secs)
    achieved = gflop / median_s
    return {
        "requests": first.num_requests,
        "prompt_tokens": first.prompt_tokens,
        "output_tokens": first.output_tokens,
        "seconds": median_s,
        "output_tokens_per_s": statistics.median(out_tps),
        "total_tokens_per_s": (first.prompt_tokens + first.output_tokens) / median_s,
        "output_tokens_per_s_min": min(out_tps),
        "output_tokens_per_s_max": max(out_tps),
        # (max - min) / median: 0 for one run; what a reader needs to judge a ratio between rows.
        "spread": (max(out_tps) - min(out_tps)) / statistics.median(out_tps),
        "model_gflop": gflop,
        "achieved_gflop_per_s": achieved,
        "ceiling_gflop_per_s": ceiling_gflops,
        "fraction_of_ceiling": achieved / ceiling_gflops,
        "runs": [{"seconds": r.seconds, "output_tokens": r.output_tokens} for r in runs],
        "errors": sorted({e for r in runs for e in r.errors}),
    }


# ---- settings and presentation -----------------------------------------------------------------
def run_settings(threads: int) -> dict:
    """What a reader needs to reproduce or discount a number: where, when, what code, how loaded."""
    return {
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # Other workers share these CPUs; a high load average before the run explains a slow row.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        # OpenMP's default spin-wait makes 2 threads on 2 shared cores many times slower than 1;
        # OMP_WAIT_POLICY=PASSIVE avoids it (docs/benchmarks.md), so a result must say which it ran under.
        "env": {k: os.environ.get(k) for k in RECORDED_ENV},
        # Decode streams its weights 5-20 % faster on 2 MB pages (model/huge_pages.py): whether it had them.
        "weights_on_huge_pages": huge_pages.enabled(),
    }


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            # "-dirty" marks numbers measured on uncommitted changes: the commit alone would mislead.
            ["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=here, capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None  # not a checkout, no git, or no commit yet
    return out.stdout.strip() or None


def format_table(rows: dict[str, dict]) -> str:
    """One line per engine; spread is half the min-max range of output tokens/s, over the median."""
    header = ("engine", "requests", "prompt tok", "output tok", "seconds", "out tok/s", "total tok/s",
              "GFLOP/s", "of ceiling", "spread")
    lines = [header]
    for name, s in rows.items():
        lines.append((
            name, str(s["requests"]), str(s["prompt_tokens"]), str(s["output_tokens"]),
            f"{s['seconds']:.2f}", f"{s['output_tokens_per_s']:.1f}", f"{s['total_tokens_per_s']:.1f}",
            f"{s['achieved_gflop_per_s']:.1f}", f"{100 * s['fraction_of_ceiling']:.1f}%",
            f"±{50 * s['spread']:.1f}%" if len(s["runs"]) > 1 else "-",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    fmt = [line[0].ljust(widths[0]) + "  " + "  ".join(c.rjust(w) for c, w in zip(line[1:], widths[1:]))
           for line in lines]
    return "\n".join(fmt)
