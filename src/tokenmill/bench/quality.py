"""`tokenmill bench quality`: how far a precision's next-token distributions are from exact fp32.

The fast path is not token-identical to fp32, so "is it still the same model?" needs a number. This
measures it the way llama.cpp's `llama-perplexity --kl-divergence` judges a quantization: run held-out
text through both engines and compare, position by position, the distributions over the next token
(top-1 agreement, each engine's perplexity, KL(exact || candidate)).

Windows follow llama-perplexity's chunks: the text is cut into windows of `--window` tokens, each run
from position 0 on a fresh sequence, and only the second half of each window is scored, so every scored
position sees at least half a window of context (early positions measure the lack of context, not the
engine). A trailing partial window is dropped, as llama-perplexity drops it.

llama-perplexity runs each chunk as one batch, which only exercises the prompt-processing path. Here
`prefill` mode does the same, and `decode` mode prefills the unscored first half, then feeds the scored
half one token per step, several windows side by side as decode rows: the small-row kernels and the
decode attention kernel that generation runs on, which a 512-row prefill never reaches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import Any

import torch

from tokenmill.bench.arg_types import at_least
from tokenmill.config import KV_CACHE_DTYPES, PRECISIONS, PROMPT_GEMMS, EngineConfig

# The bounds: Q4_1 weights are the same numbers in both paths and only activation precision
# differs, so the argmax should almost never move and perplexity should barely change.
TOP1_MIN = 0.98
PPL_REL_MAX = 0.02
# Rows of log-softmax done at once in float64: 256 x 49152 x 8 bytes = 100 MB per tensor, not GBs.
ROW_BLOCK = 256

MODES = ("prefill", "decode")

# (windows, first) -> per window, fp32 logits of rows first .. len - 2, row i predicting token i + 1;
# each window is a fresh sequence from position 0. Several windows per call let decode batch them.
LogitsFn = Callable[[list[list[int]], int], list[torch.Tensor]]


@dataclass(frozen=True)
class PositionScores:
    """Per scored position, float64: what each engine pays for the true next token, and how they differ."""

    nll_reference: torch.Tensor
    nll_candidate: torch.Tensor
    kl: torch.Tensor  # KL(reference || candidate), nats
    agree: torch.Tensor  # bool: same argmax
    # bool: the candidate's top logit is shared by several tokens. Logits rounded to bf16 (8-bit
    # mantissa: steps of 0.0625 near 10) tie often, and argmax then takes the lowest id, which is
    # what greedy sampling does too; this tells such disagreements from real ones.
    tied: torch.Tensor


@dataclass(frozen=True)
class QualityReport:
    window: int
    windows: int
    positions: int  # scored positions, all windows together
    top1_agreement: float
    ppl_reference: float
    ppl_candidate: float
    kl_mean: float  # nats
    kl_p99: float
    kl_max: float
    candidate_top_ties: float  # fraction of positions where the candidate's top logit is tied
    seconds_reference: float = 0.0
    seconds_candidate: float = 0.0

    @property
    def ppl_rel_change(self) -> float:
        return self.ppl_candidate / self.ppl_reference - 1.0

    @property
    def top1_ok(self) -> bool:
        return self.top1_agreement >= TOP1_MIN

    @property
    def ppl_ok(self) -> bool:
        return abs(self.ppl_rel_change) <= PPL_REL_MAX

    @property
    def passed(self) -> bool:
        return self.top1_ok and self.ppl_ok


def score_positions(reference: torch.Tensor, candidate: torch.Tensor, targets: torch.Tensor) -> PositionScores:
    """Compare two [n, vocab] logit matrices whose row i predicts targets[i].

    float64 throughout: KL between two close distributions is a small difference of large sums, and in
    fp32 the rounding of 49k terms is of the same order as the effect measured.
    """
    parts = []
    for lo in range(0, reference.shape[0], ROW_BLOCK):
        ref = torch.log_softmax(reference[lo:lo + ROW_BLOCK].double(), dim=-1)
        cand = torch.log_softmax(candidate[lo:lo + ROW_BLOCK].double(), dim=-1)
        tgt = targets[lo:lo + ROW_BLOCK].unsqueeze(1)
        top = cand.max(dim=-1, keepdim=True).values
        parts.append((
            -ref.gather(1, tgt).squeeze(1),
            -cand.gather(1, tgt).squeeze(1),
            (ref.exp() * (ref - cand)).sum(dim=-1),
            ref.argmax(dim=-1) == cand.argmax(dim=-1),
            (cand == top).sum(dim=-1) > 1,
        ))
    return PositionScores(*(torch.cat([p[k] for p in parts]) for k in range(5)))


def summarize_scores(scores: Sequence[PositionScores], window: int) -> QualityReport:
    if not scores or sum(s.kl.numel() for s in scores) == 0:
        raise ValueError("no scored positions: the text is shorter than one window")
    nll_ref = torch.cat([s.nll_reference for s in scores])
    nll_cand = torch.cat([s.nll_candidate for s in scores])
    kl = torch.cat([s.kl for s in scores])
    agree = torch.cat([s.agree for s in scores])
    tied = torch.cat([s.tied for s in scores])
    return QualityReport(
        window=window,
        windows=len(scores),
        positions=kl.numel(),
        top1_agreement=agree.double().mean().item(),
        ppl_reference=math.exp(nll_ref.mean().item()),
        ppl_candidate=math.exp(nll_cand.mean().item()),
        kl_mean=kl.mean().item(),
        kl_p99=torch.quantile(kl, 0.99).item(),
        kl_max=kl.max().item(),
        candidate_top_ties=tied.double().mean().item(),
    )


def split_windows(token_ids: Sequence[int], window: int, bos_token_id: int | None = None) -> list[list[int]]:
    """Full windows of `window` tokens; the tail that does not fill one is dropped.

    For a model whose tokenizer prepends BOS, every window starts with BOS in place of its first token
    (llama-perplexity does the same), so each window looks like the start of a document.
    """
    if window < 4:
        raise ValueError(f"window must be >= 4 tokens, got {window}")
    out = []
    for start in range(0, len(token_ids) - window + 1, window):
        ids = list(token_ids[start:start + window])
        if bos_token_id is not None:
            ids[0] = bos_token_id
        out.append(ids)
    return out


def measure_quality(
    reference: LogitsFn,
    candidate: LogitsFn,
    token_ids: Sequence[int],
    window: int = 512,
    bos_token_id: int | None = None,
    max_windows: int | None = None,
    windows_per_call: int = 1,
) -> QualityReport:
    """Score `candidate` against `reference` on the second half of each window of `token_ids`."""
    windows = split_windows(token_ids, window, bos_token_id)[:max_windows]
    first = window // 2  # llama-perplexity's `first = n_ctx / 2`: rows first .. window-2 are scored
    scores, seconds = [], [0.0, 0.0]
    for g in range(0, len(windows), windows_per_call):
        group = windows[g:g + windows_per_call]
        logits = []
        for k, fn in enumerate((reference, candidate)):
            start = time.perf_counter()
            logits.append(fn(group, first))
            seconds[k] += time.perf_counter() - start
        for ids, ref, cand in zip(group, *logits):
            if ref.shape[0] != window - 1 - first or cand.shape[0] != window - 1 - first:
                raise ValueError(f"expected {window - 1 - first} logit rows, got {ref.shape[0]} and {cand.shape[0]}")
            scores.append(score_positions(ref, cand, torch.tensor(ids[first + 1:], dtype=torch.long)))
    report = summarize_scores(scores, window)
    return QualityReport(**{**asdict(report), "seconds_reference": seconds[0], "seconds_candidate": seconds[1]})


def engine_logits(core: Any, mode: str = "prefill") -> LogitsFn:
    """Logits of the scored rows, straight from an engine core's runner, by prefill or by decode steps.

    The core is fresh and runs nothing else, so its pages are free: window k of a call takes pages
    [k * P, (k + 1) * P) and the next call reuses them. Stale K/V beyond a sequence's length is never
    read (attention stops at the sequence's length).
    """
    from tokenmill.model.runner import SeqChunk

    runner = core.runner

    def page_lists(windows: list[list[int]]) -> list[list[int]]:
        per = -(-max(len(w) for w in windows) // runner.page_size)
        if per * len(windows) > runner.num_pages:
            raise ValueError(f"{len(windows)} windows need {per * len(windows)} KV pages; the pool has "
                             f"{runner.num_pages}")
        return [list(range(k * per, (k + 1) * per)) for k in range(len(windows))]

    def prefill(windows: list[list[int]], first: int) -> list[torch.Tensor]:
        out = []
        for ids, pages in zip(windows, page_lists(windows)):
            chunk = SeqChunk(token_ids=ids, start=0, pages=pages, sample=True, all_logits=True)
            out.append(runner.execute([chunk])[first:-1])
        return out

    def decode(windows: list[list[int]], first: int) -> list[torch.Tensor]:
        pages = page_lists(windows)
        # The unscored first halves: one prefill step, no logits wanted.
        runner.execute([SeqChunk(ids[:first], 0, p, sample=False) for ids, p in zip(windows, pages)])
        rows = []
        for pos in range(first, len(windows[0]) - 1):
            # One token per window: every chunk is a decode row, as in generation.
            rows.append(runner.execute([SeqChunk([ids[pos]], pos, p, sample=True) for ids, p in zip(windows, pages)]))
        return list(torch.stack(rows, dim=1).unbind(0))

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return prefill if mode == "prefill" else decode


def held_out_text_path() -> str:
    # Inside the package so that an installed tokenmill finds it too; the tests read this same copy.
    return str(resources.files("tokenmill.bench").joinpath("data", "heldout.txt"))


# ---- command line ------------------------------------------------------------------------------
def add_quality_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "quality", help="next-token distributions of --precision vs exact fp32 on held-out text (KL, top-1, ppl)"
    )
    p.add_argument("--text", default=None, help="UTF-8 text file (default: the bundled held-out prose)")
    # half of a window is scored, minus its last row: fewer than 4 tokens leaves almost nothing
    p.add_argument("--window", type=at_least(4), default=512, help="tokens per window; the second half of each is scored")
    p.add_argument("--chunks", type=at_least(1), default=None, help="score at most this many windows (default: all)")
    p.add_argument("--mode", choices=[*MODES, "both"], default="both",
                   help="prefill: each window in one pass; decode: the scored half one token per step")
    p.add_argument("--decode-batch", type=at_least(1), default=8,
                   help="windows decoded side by side in decode mode: the rows of each decode step")
    p.add_argument("--precision", choices=PRECISIONS, default="fast", help="the candidate; exact is the reference")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="the candidate's KV cache dtype")
    p.add_argument("--prompt-gemm", choices=PROMPT_GEMMS, default="auto",
                   help="the candidate's prompt GEMM for quantized weights (prefill windows run it)")
    p.add_argument("--reference-precision", choices=PRECISIONS, default="exact",
                   help="the reference (with its own auto KV dtype): fast with --kv-cache-dtype int8 measures int8 "
                        "K/V against bf16 K/V, everything else equal")
    p.add_argument("--reference-mode", choices=["same", *MODES], default="same",
                   help="run the reference this way whatever --mode says: with --reference-precision fast, "
                        "`--reference-mode prefill --mode decode` measures the floor, how often two fast runs "
                        "that differ only in batch shape disagree")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M)")
    p.add_argument("--json", metavar="PATH", default=None, help="write settings and results here")
    p.set_defaults(func=cmd_quality)


def cmd_quality(args: argparse.Namespace) -> int:
    from tokenmill.bench.common import run_settings
    from tokenmill.engine.factory import build_engine_core
    from tokenmill.frontend.tokenizer import Tokenizer
    from tokenmill.model.default_model import default_model_path

    model = os.path.abspath(os.path.expanduser(args.model)) if args.model else None
    text_path = args.text or held_out_text_path()
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    tokenizer = Tokenizer.from_model_path(model or default_model_path())
    # The model's own rule: a leading BOS here means every window should start with one.
    token_ids = tokenizer.encode(text)
    bos = tokenizer.bos_token_id if token_ids[:1] == [tokenizer.bos_token_id] else None
    if len(token_ids) < args.window:
        print(f"error: {text_path} has {len(token_ids)} tokens, fewer than one window of {args.window}",
              file=sys.stderr)
        return 2

    # Pages for the windows decoded side by side; a context of one window is all RoPE must cover.
    page = EngineConfig().page_size
    kv_tokens = args.decode_batch * -(-args.window // page) * page
    # engine_logits hands the runner page lists itself: one KV group (a hybrid cache's sliding groups
    # would need theirs too; the logits are the same either way).
    base = EngineConfig(model=model, num_threads=args.num_threads, kv_cache_tokens=kv_tokens, max_model_len=args.window,
                        hybrid_kv_cache=False)
    # The same settings on both sides (`--precision exact`: a sanity check, KL 0) share one core.
    ref_config = replace(base, precision=args.reference_precision)
    cand_config = replace(base, precision=args.precision, kv_cache_dtype=args.kv_cache_dtype,
                          prompt_gemm=args.prompt_gemm)
    ref_core = build_engine_core(ref_config)
    cores = {"reference": ref_core, "candidate": ref_core if cand_config == ref_config else build_engine_core(cand_config)}
    context = cores["reference"].max_model_len  # the model's own limit, if smaller than the window
    if context < args.window:
        print(f"error: --window {args.window} exceeds the model's context of {context} tokens", file=sys.stderr)
        return 2
    settings = run_settings(base.threads)
    reports = {}
    for mode in MODES if args.mode == "both" else (args.mode,):
        ref_mode = mode if args.reference_mode == "same" else args.reference_mode
        reports[mode] = measure_quality(
            engine_logits(cores["reference"], ref_mode), engine_logits(cores["candidate"], mode), token_ids,
            args.window, bos, args.chunks, windows_per_call=args.decode_batch if mode == "decode" else 1,
        )
    settings["load_average_end"] = run_settings(base.threads)["load_average"]
    _print_reports(reports, args, len(token_ids), text_path, settings)
    passed = all(r.passed for r in reports.values())
    if args.json:
        results = {m: {**asdict(r), "ppl_rel_change": r.ppl_rel_change, "passed": r.passed} for m, r in reports.items()}
        with open(args.json, "w") as f:
            json.dump({"settings": {**settings, "text": text_path, "text_tokens": len(token_ids),
                                    "reference": args.reference_precision, "candidate": _candidate(args),
                                    "args": {k: v for k, v in vars(args).items() if k != "func"}},
                       "bounds": {"top1_min": TOP1_MIN, "ppl_rel_max": PPL_REL_MAX},
                       "results": results, "passed": passed}, f, indent=2)
    return 0 if passed else 1


def _candidate(args: argparse.Namespace) -> str:
    """The candidate's label: its precision, and its KV dtype and prompt GEMM when asked for."""
    label = args.precision if args.kv_cache_dtype == "auto" else f"{args.precision}+kv-{args.kv_cache_dtype}"
    return label if args.prompt_gemm == "auto" else f"{label}+prompt-{args.prompt_gemm}"


def _print_reports(reports: dict[str, QualityReport], args: argparse.Namespace, text_tokens: int, text_path: str,
                   settings: dict) -> None:
    load, cand, ref = settings["load_average"], _candidate(args), args.reference_precision
    if args.reference_mode != "same":
        ref = f"{ref}-{args.reference_mode}"
    any_report = next(iter(reports.values()))
    print(f"{os.path.basename(text_path)}: {text_tokens} tokens, {any_report.windows} windows of {args.window}, "
          f"second half of each scored: {any_report.positions} positions; candidate {cand}, reference {ref}; "
          f"{settings['threads']} threads, load average {'n/a' if load is None else f'{load[0]:.2f}'}")
    verdict = {True: "PASS", False: "FAIL"}
    for mode, r in reports.items():
        how = "each window in one pass" if mode == "prefill" else f"{args.decode_batch} decode rows per step"
        print(f"\n{mode} ({how}): {ref} {r.seconds_reference:.1f} s, {cand} {r.seconds_candidate:.1f} s")
        print(f"  top-1 agreement       {100 * r.top1_agreement:7.2f}%   bound >= {100 * TOP1_MIN:.0f}%        "
              f"{verdict[r.top1_ok]}")
        print(f"  perplexity {ref:<10} {r.ppl_reference:8.4f}")
        print(f"  perplexity {cand:<10} {r.ppl_candidate:8.4f}   {100 * r.ppl_rel_change:+.3f}%, bound within "
              f"{100 * PPL_REL_MAX:.0f}%   {verdict[r.ppl_ok]}")
        print(f"  KL({ref} || {cand}) nats: mean {r.kl_mean:.3g}, p99 {r.kl_p99:.3g}, max {r.kl_max:.3g}")
        print(f"  {cand}'s top logit tied between tokens at {100 * r.candidate_top_ties:.2f}% of positions "
              f"(coarsely rounded logits, e.g. bf16, tie; argmax then takes the lowest id)")
    print(f"\nresult: {verdict[all(r.passed for r in reports.values())]}")
