"""Speculative decoding in the engine, on the fake runner: drafts verified, rolled back, accounted.

The fake runner makes the next token a function of the whole cached prefix and checks on every step
that each computed slot holds its sequence's token, so a rejected draft whose K/V were counted as
computed, or a page handed back while still in use, fails here. The proposer is an oracle that knows
the true continuation and corrupts some of its guesses, so acceptance runs of every length occur.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tests.engine.fake_runner import make_engine, next_token, reference_output, run_to_completion
from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.sample.sampling_params import SamplingParams

VOCAB = 50


class OracleProposer:
    """Guesses the fake model's true continuation, wrong with probability `error` per token."""

    def __init__(self, error: float, seed: int = 0, skip: Sequence[str] = ()) -> None:
        self.error = error
        self.rng = random.Random(seed)
        self.skip = set(skip)  # request ids it never proposes for (non-speculative rows)
        self.calls = 0
        self.released: list[str] = []

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        self.calls += 1
        out = []
        for r, k in zip(requests, max_tokens):
            assert k >= 1 and r.num_computed_tokens == r.num_tokens - 1
            if r.request_id in self.skip:
                out.append([])
                continue
            seq = list(r.all_token_ids)
            guesses = []
            for _ in range(k):
                t = next_token(seq, VOCAB)
                if self.rng.random() < self.error:
                    t = 1 + (t % (VOCAB - 1))  # a different, valid token
                guesses.append(t)
                seq.append(t)
            out.append(guesses)
        return out

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def check_idle(self) -> None:
        pass


def spec_engine(k: int, error: float, disable_by_batch_size: int = 64, proposer=None, **config):
    spec = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=disable_by_batch_size)
    engine, runner = make_engine(VOCAB, speculative=spec, **config)
    engine.proposer = proposer or OracleProposer(error)
    return engine, runner


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("error", [0.0, 0.3, 1.0])
def test_output_identical_to_decoding_without_drafts(k, error):
    engine, runner = spec_engine(k, error)
    ps = prompts(6)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))
    out = run_to_completion(engine)
    for i, p in enumerate(ps):
        assert out[str(i)] == reference_output(p, 25, VOCAB)
    stats = engine.stats()
    assert stats["kv_pages_in_use"] == 0
    assert stats["spec_decode_num_draft_tokens_total"] > 0
    if error == 0.0:
        assert stats["spec_decode_acceptance_rate"] == 1.0
        # k + 1 tokens a step once decoding: far fewer steps than tokens.
        assert len(runner.steps) < 25 * 6 / (k + 1) + 10
    if error == 1.0:
        assert stats["spec_decode_num_accepted_tokens_total"] == 0
    assert stats["generation_tokens_total"] == 25 * 6


def test_drafts_form_one_chunk_of_k_plus_one_rows_with_other_requests():
    engine, runner = spec_engine(3, 0.0, proposer=OracleProposer(0.0, skip={"plain"}))
    engine.add_request("spec", prompts(1)[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("plain", prompts(1, seed=2)[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    out = run_to_completion(engine)
    assert out["spec"] == reference_output(prompts(1)[0], 12, VOCAB)
    assert out["plain"] == reference_output(prompts(1, seed=2)[0], 12, VOCAB)
    # After the first step: the speculative request runs 1 + 3 positions, the other one.
    second = runner.steps[1]
    assert sorted(n for _, n, _ in second) == [1, 4]


def test_chunked_prefill_and_preemption_with_drafts():
    # A small budget splits prompts, and a small pool forces preemptions mid-speculation.
    engine, runner = spec_engine(4, 0.3, max_num_batched_tokens=64, kv_cache_tokens=128, page_size=4)
    ps = prompts(8, seed=5)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    out = run_to_completion(engine)
    for i, p in enumerate(ps):
        assert out[str(i)] == reference_output(p, 40, VOCAB)
    assert engine.stats()["num_preemptions"] > 0
    # Every preempted or finished request was released on the proposer's side too.
    assert set(engine.proposer.released) >= {str(i) for i in range(8)}


def test_stop_token_inside_an_accepted_run_ends_it_there():
    p = prompts(1, seed=3)[0]
    ref = reference_output(p, 30, VOCAB)
    stop = ref[6]
    cut = ref.index(stop)
    engine, _ = spec_engine(5, 0.0)
    engine.add_request("r", p, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
        engine.check_integrity()
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens == ref[: cut + 1]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop
    assert engine.stats()["generation_tokens_total"] == cut + 1
    assert engine.stats()["kv_pages_in_use"] == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_is_never_exceeded(max_tokens):
    p = prompts(1, seed=4)[0]
    engine, _ = spec_engine(5, 0.0)
    engine.add_request("r", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    out = run_to_completion(engine)
    assert out["r"] == reference_output(p, max_tokens, VOCAB)


def test_context_limit_inside_a_run():
    p = prompts(1, seed=4)[0]
    engine, _ = spec_engine(5, 0.0, max_model_len=len(p) + 9)
    engine.add_request("r", p, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    out = run_to_completion(engine)
    assert out["r"] == reference_output(p, 9, VOCAB)


def test_rejected_drafts_give_their_pages_back():
    engine, _ = spec_engine(5, 1.0, page_size=4, kv_cache_tokens=4096)
    engine.add_request("r", [3] * 5, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        for r in engine.scheduler.running:
            # Only what the known tokens need (the last one's K/V is computed next step).
            assert len(r.pages) == engine.pool.pages_for(r.num_tokens)
    assert engine.stats()["kv_pages_in_use"] == 0


def test_speculation_off_when_the_batch_is_large():
    proposer = OracleProposer(0.0)
    engine, runner = spec_engine(3, 0.0, disable_by_batch_size=4, proposer=proposer)
    for i, p in enumerate(prompts(4)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    run_to_completion(engine)
    assert engine.stats()["spec_decode_num_drafts_total"] == 0 or proposer.calls > 0
    # With 4 running, no step carried drafts until requests finished.
    assert all(n == 1 for start, n, _ in runner.steps[1] if start > 0)


def test_no_proposals_beyond_what_the_request_may_still_produce():
    proposer = OracleProposer(0.0)
    engine, _ = spec_engine(5, 0.0, proposer=proposer)
    engine.add_request("r", prompts(1)[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()  # prefill + first token: 2 more allowed, so at most 1 draft + the bonus
    assert len(engine.requests["r"].spec_token_ids) == 1


def test_randomized_run_with_aborts_stop_strings_and_preemptions():
    rng = random.Random(7)
    engine, _ = spec_engine(4, 0.4, max_num_batched_tokens=48, kv_cache_tokens=96, page_size=4)
    live: set[str] = set()
    given: dict[str, tuple[list[int], int]] = {}
    got: dict[str, list[int]] = {}
    completed: set[str] = set()
    next_id = 0
    for _ in range(300):
        if rng.random() < 0.4 and next_id < 60:
            p = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 30))]
            rid = str(next_id)
            next_id += 1
            n = rng.randrange(1, 50)
            engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            given[rid] = (p, n)
            live.add(rid)
        if live and rng.random() < 0.1:
            rid = rng.choice(sorted(live))
            # An abort, or a stop string the frontend found (same release path, another status).
            status = RequestStatus.FINISHED_ABORTED if rng.random() < 0.5 else RequestStatus.FINISHED_STOPPED
            engine.finish_request(rid, status, stop_reason="x" if status == RequestStatus.FINISHED_STOPPED else None)
            live.discard(rid)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                live.discard(out.request_id)
                completed.add(out.request_id)
        engine.check_integrity()
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                completed.add(out.request_id)
        engine.check_integrity()
    assert len(completed) > 10
    for rid in completed:  # ran to max_tokens: exactly the non-speculative output
        p, n = given[rid]
        assert got[rid] == reference_output(p, n, VOCAB)
    assert engine.pool.num_free + engine.scheduler.num_cached_pages == engine.pool.num_pages
    assert engine.stats()["num_preemptions"] > 0


def seeded_outputs(k: int | None, companions: int = 0, **config) -> dict[str, list[int]]:
    """Four seeded sampled requests (temperature 8: the fake model's true token has ~13 % of the
    mass, so most draws are real draws) beside `companions` unseeded ones; k drafts a step, or none."""
    if k is None:
        engine, _ = make_engine(VOCAB, **config)
    else:
        engine, _ = spec_engine(k, 0.3, **config)
    for i, p in enumerate(prompts(4, seed=9)):
        params = SamplingParams(temperature=8.0, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True)
        engine.add_request(str(i), p, params)
    for j, p in enumerate(prompts(companions, seed=11)):
        engine.add_request(f"other-{j}", p, SamplingParams(temperature=1.5, max_tokens=10, ignore_eos=True))
    out = run_to_completion(engine)
    if k is not None:
        assert engine.stats()["spec_decode_num_draft_tokens_total"] > 0
        assert engine.stats()["spec_decode_num_accepted_tokens_total"] > 0
    return {rid: toks for rid, toks in out.items() if not rid.startswith("other")}


def test_a_seeded_request_samples_the_same_tokens_with_or_without_speculation():
    # Its draws are keyed by output position (sample/position_seeds.py): neither the drafts a step
    # got (k, cut by the budget and the batch) nor the rows rejected after a miss move them.
    plain = seeded_outputs(None)
    assert all(len(v) == 24 for v in plain.values())
    assert all(v != reference_output(p, 24, VOCAB) for v, p in zip(plain.values(), prompts(4, seed=9)))
    assert seeded_outputs(1) == plain
    assert seeded_outputs(3) == plain
    assert seeded_outputs(5, companions=6, max_num_batched_tokens=24) == plain
    assert seeded_outputs(4, companions=6, disable_by_batch_size=5) == plain
    assert seeded_outputs(None, companions=6, kv_cache_tokens=160, page_size=4) == plain
