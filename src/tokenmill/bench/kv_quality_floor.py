"""How far int8 K/V moves a model's next-token choices, measured against the noise floor of fast mode.

Why a script of its own: `tokenmill bench quality` compares two engines; deciding an int8 KV format
needs several at once on the same positions (bf16 K/V, the same again with the prompt cut into chunks,
fp32 K/V, exact mode, int8 with a scale per row or per group of values), each against bf16 K/V and
against exact fp32, with the share of disagreements that are near-ties of the reference. Every variant
runs the real kernels of fast mode in prefill (each chunk's attention reads the K/V just written to the
cache, so every scored position sees quantized K/V): the int8 group sizes that have no kernel are
simulated by an fp32 cache whose rows are rounded in place to exactly the numbers an int8 row with that
grouping decodes to (`group=64` simulated next to the real int8 rows checks the simulation), of the
rotated rows the format stores (kv_cache_format.py) or, the `plain` variants, of the values themselves.

Windows of `--window` tokens start every `--window / 2` tokens and score only their second half, so
every position of the text after the first half window is scored once, with at least half a window
of context (llama-perplexity's rule, without dropping half the text).

    python -m tokenmill.bench.kv_quality_floor --window 512 --json /tmp/kv_floor.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.model.kernels import fused_ops
from tokenmill.model.kv_cache_format import rotate

NEAR_TIE = 0.05  # the reference's top-2 logit margin under which a disagreement is a near-tie
# (int8 group size, rotated) the patched rope_store rounds to (None: off)
_SIM: list[tuple[int, bool] | None] = [None]


def fake_int8(rows: torch.Tensor, group: int, rotated: bool = True) -> torch.Tensor:
    """The values int8 rows with one scale per `group` values decode to (the C++ writer's rounding:
    scale = amax / 127, code = round-half-even(x * 127 / amax), value = code * scale), of H x and
    rotated back (the shipped format, kv_cache_format.py) or, not `rotated`, of x itself."""
    x = rotate(rows) if rotated else rows.float()
    x = x.reshape(*rows.shape[:-1], -1, group)
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    values = (torch.round(x * inv).clamp_(-127, 127) * (amax / 127)).reshape(rows.shape)
    return rotate(values) if rotated else values


def _install_simulation() -> None:
    real = fused_ops.rope_store

    def rope_store(qkv, cos, sin, nq, nkv, k_cache, v_cache, slots, q_bf16=False):
        q = real(qkv, cos, sin, nq, nkv, k_cache, v_cache, slots, q_bf16)
        if _SIM[0] is not None:
            for cache in (k_cache, v_cache):
                cache[:, slots] = fake_int8(cache[:, slots], *_SIM[0])
        return q

    fused_ops.rope_store = rope_store


@dataclass(frozen=True)
class Variant:
    name: str
    precision: str = "fast"
    kv_cache_dtype: str = "bf16"
    chunk: int | None = None  # prefill in chunks of this many tokens (None: one pass)
    sim_group: int | None = None  # fp32 cache rounded to int8 with this group size
    sim_rotated: bool = True  # ... of H x (the shipped format), or of x


VARIANTS = {
    v.name: v
    for v in (
        Variant("bf16"),
        Variant("bf16-chunk64", chunk=64),
        Variant("fp32", kv_cache_dtype="fp32"),
        Variant("int8-row", kv_cache_dtype="int8"),
        Variant("sim-int8-row", kv_cache_dtype="fp32", sim_group=64),
        Variant("sim-int8-g32", kv_cache_dtype="fp32", sim_group=32),
        # the format before rows were rotated (docs/benchmarks.md's 2026-12-02 tables)
        Variant("sim-int8-plain-row", kv_cache_dtype="fp32", sim_group=64, sim_rotated=False),
        Variant("sim-int8-plain-g32", kv_cache_dtype="fp32", sim_group=32, sim_rotated=False),
        Variant("sim-int8-plain-g16", kv_cache_dtype="fp32", sim_group=16, sim_rotated=False),
        Variant("exact", precision="exact", kv_cache_dtype="fp32"),
    )
}


@dataclass
class PairStats:
    agree: list[torch.Tensor] = field(default_factory=list)
    near_tie: list[torch.Tensor] = field(default_factory=list)  # the reference's top-2 margin < NEAR_TIE
    kl: list[torch.Tensor] = field(default_factory=list)

    def add(self, ref: torch.Tensor, cand: torch.Tensor) -> None:
        top2 = ref.topk(2, dim=-1).values
        self.near_tie.append((top2[:, 0] - top2[:, 1]) < NEAR_TIE)
        self.agree.append(ref.argmax(-1) == cand.argmax(-1))
        lr, lc = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
        self.kl.append((lr.exp() * (lr - lc)).sum(-1))

    def summary(self) -> dict:
        agree, tie, kl = torch.cat(self.agree), torch.cat(self.near_tie), torch.cat(self.kl)
        n, k = agree.numel(), int(agree.sum())
        lo, hi = wilson(k, n)
        miss = ~agree
        return {"positions": n, "top1": k / n, "top1_ci95": [lo, hi], "disagreements": int(miss.sum()),
                "near_tie_disagreements": int((miss & tie).sum()),
                "top1_without_near_ties": float(agree[~tie].double().mean()), "kl_mean": float(kl.mean())}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a binomial share (positions treated as independent, which they are not
    quite: neighbours share context, so the true interval is somewhat wider)."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def window_logits(core, variant: Variant) -> Callable[[list[int], int], torch.Tensor]:
    from tokenmill.model.runner import SeqChunk

    runner = core.runner

    def run(ids: list[int], first: int) -> torch.Tensor:
        pages = list(range(-(-len(ids) // runner.page_size)))
        step = variant.chunk or len(ids)
        _SIM[0] = None if variant.sim_group is None else (variant.sim_group, variant.sim_rotated)
        try:
            parts = [runner.execute([SeqChunk(ids[s:s + step], s, pages, sample=True, all_logits=True)])
                     for s in range(0, len(ids), step)]
        finally:
            _SIM[0] = None
        return torch.cat(parts)[first:-1]

    return run


def main(argv: list[str] | None = None) -> None:
    from tokenmill.bench.quality import held_out_text_path
    from tokenmill.config import EngineConfig
    from tokenmill.engine.factory import build_engine_core
    from tokenmill.frontend.tokenizer import Tokenizer
    from tokenmill.model.default_model import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", action="append", default=None, help="UTF-8 text file(s) (default: the bundled held-out prose)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--references", default="bf16,exact", help="variants every other is compared against")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    names = list(dict.fromkeys(a.references.split(",") + a.variants.split(",")))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    _install_simulation()
    tokenizer = Tokenizer.from_model_path(default_model_path())
    windows, half = [], a.window // 2
    for path in a.text or [held_out_text_path()]:
        ids = tokenizer.encode(Path(path).read_text(encoding="utf-8"))
        windows += [ids[s:s + a.window] for s in range(0, len(ids) - a.window + 1, half)]
    base = dict(kv_cache_tokens=a.window + 64, max_model_len=a.window, num_threads=a.num_threads)
    cores = {n: build_engine_core(EngineConfig(precision=VARIANTS[n].precision, kv_cache_dtype=VARIANTS[n].kv_cache_dtype,
                                               **base)) for n in names}
    fns = {n: window_logits(cores[n], VARIANTS[n]) for n in names}
    refs = a.references.split(",")
    pairs = {(r, n): PairStats() for r in refs for n in names if n != r}
    nll: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    start, load0 = time.time(), os.getloadavg()[0]
    for w, ids in enumerate(windows):
        logits = {n: fns[n](ids, half) for n in names}
        targets = torch.tensor(ids[half + 1:])
        for n, lg in logits.items():
            nll[n].append(-torch.log_softmax(lg.double(), -1).gather(1, targets[:, None]).squeeze(1))
        for (r, n), stats in pairs.items():
            stats.add(logits[r], logits[n])
        print(f"window {w + 1}/{len(windows)} {time.time() - start:.0f} s", flush=True)
    ppl = {n: math.exp(float(torch.cat(v).mean())) for n, v in nll.items()}
    result = {"window": a.window, "windows": len(windows), "threads": a.num_threads,
              "load": [load0, os.getloadavg()[0]], "near_tie_margin": NEAR_TIE, "perplexity": ppl,
              "pairs": {f"{n} vs {r}": {**s.summary(), "ppl_rel_change": ppl[n] / ppl[r] - 1} for (r, n), s in pairs.items()}}
    print(f"{len(windows)} windows of {a.window}, load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'candidate vs reference':28s} {'top-1':>7s} {'95% CI':>15s} {'miss':>5s} {'ties':>5s} "
          f"{'top-1 w/o ties':>14s} {'ppl':>8s} {'KL':>9s}")
    for key, s in result["pairs"].items():
        lo, hi = s["top1_ci95"]
        print(f"{key:28s} {100 * s['top1']:6.2f}% [{100 * lo:5.2f}-{100 * hi:5.2f}] {s['disagreements']:5d} "
              f"{s['near_tie_disagreements']:5d} {100 * s['top1_without_near_ties']:13.2f}% "
              f"{100 * s['ppl_rel_change']:+7.3f}% {s['kl_mean']:9.2e}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
