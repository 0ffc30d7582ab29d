"""The sampler's draws follow the exact filtered distribution (chi-square at a fixed seed)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.sample import sampler as sampler_mod
from tokenmill.sample.sampler import Sampler
from tokenmill.sample.sampling_batch import SamplingBatch
from tokenmill.sample.sampling_params import SamplingParams

ROWS = 2000
CALLS = 10  # ROWS x CALLS = 20k draws per case
# z for a one-sided p-value of 1e-3. No scipy here: the chi-square critical value comes from the
# Wilson-Hilferty approximation, accurate to ~1% for df >= 3 (df=10: 29.64 vs table 29.59).
Z_999 = 3.0902


def chi2_critical(df: int) -> float:
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_999 * math.sqrt(a)) ** 3


def reference(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Written independently of the sampler, in float64: temperature, min_p, top_k, top_p (vLLM v1)."""
    prob = torch.softmax(logits.double() / t, dim=-1)
    keep = torch.ones_like(prob, dtype=torch.bool)
    if min_p > 0:
        keep &= prob >= min_p * prob.max()
    order = torch.argsort(prob, descending=True, stable=True).tolist()
    if top_k > 0:
        for tok in order[top_k:]:
            keep[tok] = False
    if top_p < 1.0:
        mass = (prob * keep).sum()
        above = 0.0
        for tok in order:
            if not keep[tok]:
                continue
            if above >= top_p:
                keep[tok] = False
            above += prob[tok].item() / mass.item()
    out = prob * keep
    return out / out.sum()


def draw(
    logits: torch.Tensor, params: SamplingParams, seeded: bool = False, seed: int = 1234
) -> torch.Tensor:
    """Counts per token over ROWS x CALLS draws with the same params."""
    sampler = Sampler(logits.shape[0], eos_token_ids=[], seed=seed)
    counts = torch.zeros(logits.shape[0], dtype=torch.long)
    batch_logits = logits.expand(ROWS, -1).contiguous()
    gens = [torch.Generator().manual_seed(seed + i) if seeded else None for i in range(ROWS)]
    batch = SamplingBatch([params] * ROWS, gens, [[]] * ROWS, [[]] * ROWS)
    for _ in range(CALLS):
        tokens = sampler(batch_logits, batch).token_ids
        counts += torch.bincount(tokens, minlength=logits.shape[0])
    return counts


def assert_matches(counts: torch.Tensor, expected: torch.Tensor) -> None:
    excluded = expected == 0
    assert counts[excluded].sum() == 0, (
        f"excluded tokens drawn: {counts[excluded].nonzero().view(-1).tolist()}"
    )
    n = counts.sum().item()
    exp = expected[~excluded] * n
    obs = counts[~excluded].double()
    # Chi-square needs expected counts >= 5: pool the thinnest bins into one until it has 5.
    order = torch.argsort(exp)
    exp, obs = exp[order], obs[order]
    cut = 0
    while exp[cut:].numel() > 1 and exp[: cut + 1].sum() < 5:
        cut += 1
    if cut:
        exp = torch.cat([exp[: cut + 1].sum().view(1), exp[cut + 1 :]])
        obs = torch.cat([obs[: cut + 1].sum().view(1), obs[cut + 1 :]])
    assert (exp >= 5).all(), "test case too thin for chi-square"
    if exp.numel() == 1:
        return
    stat = ((obs - exp) ** 2 / exp).sum().item()
    df = exp.numel() - 1
    assert stat < chi2_critical(df), f"chi2={stat:.1f} >= {chi2_critical(df):.1f} (df={df})"


LOGITS16 = torch.tensor(
    [2.0, 1.7, 1.5, 1.2, 1.0, 0.9, 0.5, 0.3, 0.0, -0.2, -0.5, -0.8, -1.0, -1.5, -2.0, -3.0]
)

CASES = {
    "t1": dict(temperature=1.0),
    "t0.5": dict(temperature=0.5),
    "t1.7": dict(temperature=1.7),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "k_p": dict(temperature=0.8, top_k=8, top_p=0.8),
    "all": dict(temperature=1.3, top_k=10, top_p=0.9, min_p=0.1),
    "p_min_p": dict(temperature=1.0, top_p=0.85, min_p=0.15),
}


def _expected(logits: torch.Tensor, kw: dict) -> torch.Tensor:
    return reference(
        logits, kw.get("temperature", 1.0), kw.get("top_k", -1), kw.get("top_p", 1.0), kw.get("min_p", 0.0)
    )


@pytest.mark.parametrize("name", list(CASES))
def test_distribution_unseeded(name: str) -> None:
    kw = CASES[name]
    assert_matches(draw(LOGITS16, SamplingParams(**kw)), _expected(LOGITS16, kw))


@pytest.mark.parametrize("name", ["t1", "all"])
def test_distribution_seeded_rows(name: str) -> None:
    # Each row has its own generator: covers the per-row noise paths (full vocab and candidates).
    kw = CASES[name]
    assert_matches(draw(LOGITS16, SamplingParams(**kw), seeded=True), _expected(LOGITS16, kw))


def test_top_p_keeps_boundary_token() -> None:
    # p = [0.4, 0.3, 0.2, 0.1]: prefix masses 0.4 < 0.6 <= 0.7, so token 1 crosses 0.6 and is kept.
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    counts = draw(logits, SamplingParams(top_p=0.6))
    assert counts[1] > 0
    assert_matches(counts, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0], dtype=torch.float64))
    # A top_p below the first token's mass keeps exactly that token.
    counts = draw(logits, SamplingParams(top_p=0.3))
    assert counts[0] == counts.sum()


@pytest.mark.parametrize(
    "kw",
    [dict(top_p=0.9), dict(top_p=0.5), dict(top_k=12), dict(min_p=0.3), dict(top_k=12, top_p=0.95)],
    ids=["nucleus_sort", "nucleus_cap", "top_k_threshold", "min_p_few", "k_threshold_p"],
)
def test_distribution_candidate_stages(monkeypatch: pytest.MonkeyPatch, kw: dict) -> None:
    # Tiny stage sizes so a flat 20-token row goes through topk(4) -> topk(8) -> full sort, and a top_k
    # above the cap goes through the threshold path.
    monkeypatch.setattr(sampler_mod, "_START_K", 4)
    monkeypatch.setattr(sampler_mod, "_CAP_K", 8)
    logits = torch.linspace(1.0, -1.0, 20)
    assert_matches(draw(logits, SamplingParams(**kw)), _expected(logits, kw))


def test_mixed_params_batch_distribution() -> None:
    # Rows with different filters in one call: each must follow its own distribution.
    kinds = [CASES["top_k"], CASES["top_p"], CASES["t0.5"], CASES["all"]]
    sampler = Sampler(16, [], seed=7)
    params = [SamplingParams(**kinds[i % 4]) for i in range(ROWS)]
    batch = SamplingBatch(params, [None] * ROWS, [[]] * ROWS, [[]] * ROWS)
    logits = LOGITS16.expand(ROWS, -1).contiguous()
    counts = torch.zeros(4, 16, dtype=torch.long)
    for _ in range(2 * CALLS):
        tokens = sampler(logits, batch).token_ids.view(-1, 4)
        for j in range(4):
            counts[j] += torch.bincount(tokens[:, j], minlength=16)
    for j in range(4):
        assert_matches(counts[j], _expected(LOGITS16, kinds[j]))


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("name", ["t1", "t1.7", "min_p"])
def test_distribution_two_stage_unfiltered(monkeypatch: pytest.MonkeyPatch, name: str, seeded: bool) -> None:
    # Head of 4 tokens out of 16: both the head draw and the tail draw happen often.
    monkeypatch.setattr(sampler_mod, "_START_K", 4)
    monkeypatch.setattr(sampler_mod, "_CAP_K", 2)  # keeps min_p rows on the unfiltered path
    kw = CASES[name]
    assert_matches(draw(LOGITS16, SamplingParams(**kw), seeded=seeded), _expected(LOGITS16, kw))


def test_two_stage_tail_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    # Force stage 2 (uniform = 1 >= any head mass): the draw follows the distribution outside the head.
    monkeypatch.setattr(sampler_mod, "_START_K", 4)
    monkeypatch.setattr(sampler_mod, "_uniform", lambda t, g: t.fill_(1.0))
    expected = torch.softmax(LOGITS16.double(), dim=-1)
    expected[:4] = 0.0
    assert_matches(draw(LOGITS16, SamplingParams()), expected / expected.sum())


def test_two_stage_with_nothing_outside_the_head(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only 3 tokens left after bad words, head of 4; even when stage 2 is picked (forced here, rounding
    # in real life) the all -inf tail must not be raced: the draw stays in the head.
    monkeypatch.setattr(sampler_mod, "_START_K", 4)
    monkeypatch.setattr(sampler_mod, "_uniform", lambda t, g: t.fill_(1.0))
    logits = torch.tensor([1.0, 0.0, -1.0] + [5.0] * 13)
    params = SamplingParams(bad_words_token_ids=list(range(3, 16)))
    expected = torch.cat([torch.softmax(logits[:3].double(), dim=-1), torch.zeros(13, dtype=torch.float64)])
    assert_matches(draw(logits, params), expected)
