"""The draft-model proposer on a tiny random model: its drafts are the draft model's own greedy
continuation, its cache survives partial acceptance, its pages never leak, and an engine speculating
with it emits exactly what the same engine emits without speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.fake_runner import run_to_completion
from tests.tiny_models import VOCAB_SIZE, make_tiny_model
from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.factory import build_engine_core
from tokenmill.engine.request import Request
from tokenmill.engine.spec.draft import DraftModelProposer, build_draft_proposer
from tokenmill.errors import InvalidRequest
from tokenmill.model.runner import SeqChunk
from tokenmill.sample.sampling_params import SamplingParams

PAGE = 16  # EngineConfig's default page size


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", tokenizer=False)


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(100, VOCAB_SIZE, (length,), generator=g)]


PROMPTS = [prompt(1, 5), prompt(2, 14), prompt(3, 23)]


def engine(folder: Path, precision: str = "exact", kv_cache_tokens: int = 256, **kwargs) -> EngineCore:
    return build_engine_core(
        EngineConfig(model=str(folder), precision=precision, num_threads=1, kv_cache_tokens=kv_cache_tokens, **kwargs)
    )


def greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        core.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    out = run_to_completion(core)
    return [out[str(i)] for i in range(len(prompts))]


def proposer(folder: Path, precision: str = "exact", quantization: str = "auto",
             kv_cache_tokens: int = 256) -> DraftModelProposer:
    spec = {"method": "draft", "draft_precision": precision, "draft_quantization": quantization}
    config = EngineConfig(model=str(folder), precision="exact", num_threads=1, kv_cache_tokens=kv_cache_tokens,
                          speculative=spec)
    return build_draft_proposer(config, VOCAB_SIZE)


def request(rid: str, ids: list[int]) -> Request:
    return Request(rid, list(ids), SamplingParams(temperature=0), max_tokens=64)


def record_chunks(p: DraftModelProposer) -> list[list[SeqChunk]]:
    """Every batch the draft runner executes, from now on."""
    calls: list[list[SeqChunk]] = []
    execute = p.runner.execute

    def spy(chunks: list[SeqChunk]) -> torch.Tensor:
        calls.append([SeqChunk(list(c.token_ids), c.start, list(c.pages), c.sample) for c in chunks])
        return execute(chunks)

    p.runner.execute = spy  # type: ignore[method-assign]
    return calls


@pytest.fixture(scope="module")
def reference(folder) -> list[list[int]]:
    """The model's own greedy continuation of each prompt (an engine without speculation)."""
    return greedy(engine(folder), PROMPTS, 8)


def test_drafts_are_the_draft_models_greedy_continuation(folder, reference):
    p = proposer(folder)
    calls = record_chunks(p)
    ks = [5, 1, 3]
    drafts = p.propose([request(str(i), ids) for i, ids in enumerate(PROMPTS)], ks)
    assert drafts == [ref[:k] for ref, k in zip(reference, ks)]
    # One batch for the prompts, then one per further draft position, with rows only for requests
    # that still want more.
    assert [len(batch) for batch in calls] == [3, 2, 2, 1, 1]


def test_state_survives_partial_acceptance(folder, reference):
    p = proposer(folder)
    calls = record_chunks(p)
    ids = PROMPTS[1]  # 14 tokens: the drafts cross into a second page
    r = request("a", ids)
    (first,) = p.propose([r], [4])
    assert first == reference[1][:4]
    assert p.pool.num_pages - p.pool.num_free == 2  # positions 0..16: prompt + 3 fed drafts

    # The target keeps one draft and picks another token instead of the second.
    other = (first[1] + 1) % VOCAB_SIZE
    r.append_output(first[0])
    r.append_output(other)
    calls.clear()
    (again,) = p.propose([r], [1])
    assert calls[0][0].start == len(ids) + 1 and calls[0][0].token_ids == [other]  # only the new token ran
    assert p.pool.num_pages - p.pool.num_free == 1  # the page that held only rejected drafts went back
    fresh = proposer(folder)
    assert [again] == fresh.propose([request("a", r.all_token_ids)], [1])

    # All drafts accepted plus the target's own token: the cache lacks only the last draft and it.
    r.append_output(again[0])
    (more,) = p.propose([r], [3])
    r.append_output(more[0])
    r.append_output(more[1])
    r.append_output(more[2])
    r.append_output(7)
    calls.clear()
    (last,) = p.propose([r], [3])
    assert calls[0][0].token_ids == [more[2], 7]
    assert [last] == fresh.propose([request("b", r.all_token_ids)], [3])

    # Tokens that diverge from the cache well before its end (what a reused id would look like).
    rewritten = request("a", ids[:3] + prompt(9, 20))
    calls.clear()
    assert p.propose([rewritten], [2]) == fresh.propose([request("c", rewritten.all_token_ids)], [2])
    assert calls[0][0].start == 3


def test_release_and_check_idle(folder):
    p = proposer(folder)
    p.propose([request("a", PROMPTS[0]), request("b", PROMPTS[2])], [3, 2])
    with pytest.raises(AssertionError):
        p.check_idle()
    p.release("a")
    p.release("never-seen")  # no-op
    with pytest.raises(AssertionError):
        p.check_idle()
    p.release("b")
    p.check_idle()
    assert p.pool.num_free == p.pool.num_pages


def test_a_dry_pool_gives_no_drafts_and_keeps_nothing(folder, reference):
    p = proposer(folder, kv_cache_tokens=2 * PAGE)
    # "a" takes both pages (23 tokens + 3 fed drafts), so "b" finds none; "c" would not fit anyway.
    drafts = p.propose([request("a", PROMPTS[2]), request("b", PROMPTS[0]), request("c", prompt(4, 40))], [4, 2, 2])
    assert drafts == [reference[2][:4], [], []]
    assert p.pool.num_free == 0
    p.release("a")
    p.check_idle()
    # Once "a" is gone "b" fits again.
    assert p.propose([request("b", PROMPTS[0])], [2]) == [reference[0][:2]]
    p.release("b")
    p.check_idle()


def test_bad_settings_name_the_parameter(folder):
    with pytest.raises(InvalidRequest) as e:
        proposer(folder, precision="exact", quantization="int8")
    assert e.value.param == "draft_quantization"
    config = EngineConfig(model=str(folder), num_threads=1, kv_cache_tokens=256, speculative="draft")
    with pytest.raises(InvalidRequest) as e:
        build_draft_proposer(config, 1000)
    assert e.value.param == "speculative_model" and "49152" in e.value.message and "1000" in e.value.message


SPEC_PROMPTS = [prompt(5, 7), prompt(6, 18), prompt(7, 30)]


@pytest.fixture(scope="module")
def plain(folder) -> list[list[int]]:
    return greedy(engine(folder), SPEC_PROMPTS, 12)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_identical_draft_is_always_accepted(folder, plain, k):
    spec = {"method": "draft", "num_speculative_tokens": k, "draft_precision": "exact", "draft_quantization": "auto"}
    core = engine(folder, speculative=spec)
    assert greedy(core, SPEC_PROMPTS, 12) == plain
    stats = core.stats()
    assert stats["spec_decode_num_draft_tokens_total"] > 0
    assert stats["spec_decode_acceptance_rate"] == 1.0
    core.proposer.check_idle()


# The 5-page pool preempts a request (its draft state is released with it) and runs the draft's own
# pool dry (a request then gets no drafts that step).
@pytest.mark.parametrize(("quantization", "kv_cache_tokens"), [("int8", 256), ("int8", 5 * PAGE), ("int4", 256)])
def test_quantized_draft_keeps_greedy_output(folder, plain, quantization, kv_cache_tokens):
    spec = {"method": "draft", "num_speculative_tokens": 3, "draft_precision": "fast",
            "draft_quantization": quantization}
    core = engine(folder, kv_cache_tokens=kv_cache_tokens, speculative=spec)
    assert greedy(core, SPEC_PROMPTS, 12) == plain
    stats = core.stats()
    assert stats["spec_decode_num_draft_tokens_total"] > 0
    if kv_cache_tokens < 256:
        assert stats["num_preemptions"] > 0
    core.proposer.check_idle()
