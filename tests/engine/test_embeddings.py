"""Embedding requests in the engine, on a tiny random model: the pooled vector is transformers' last
hidden state (after the final norm) pooled the same way, fp32; they share steps with generation
requests without changing either's result; and no KV page stays held or cached after them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.engine.fake_runner import run_to_completion
from tests.tiny_models import VOCAB_SIZE, make_tiny_model, reference_model
from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.factory import build_engine_core
from tokenmill.errors import InvalidRequest
from tokenmill.model.pooling import declared_pooling
from tokenmill.pooling_params import PoolingParams
from tokenmill.sample.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("embed"), "llama", tokenizer=False)


@pytest.fixture(scope="module")
def hidden(folder):
    """transformers' final hidden states (after the model's final norm) of a prompt, per position."""
    model = reference_model(folder)

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model.model(torch.tensor([ids])).last_hidden_state[0]

    return run


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(100, VOCAB_SIZE, (length,), generator=g)]


def engine(folder: Path, **kwargs) -> EngineCore:
    return build_engine_core(EngineConfig(model=str(folder), precision="exact", num_threads=1,
                                          kv_cache_tokens=512, **kwargs))


def embed(core: EngineCore, prompts: dict[str, list[int]], params: PoolingParams | None = None) -> dict:
    for rid, ids in prompts.items():
        core.add_request(rid, ids, params or PoolingParams())
    vectors = {}
    while core.has_unfinished():
        for out in core.step():
            assert out.finished and out.new_token_ids == [] and out.finish_reason == "stop"
            vectors[out.request_id] = out.embedding
        core.check_integrity()
    return vectors


def test_last_token_embedding_equals_transformers(folder, hidden):
    core = engine(folder)
    ids = prompt(1, 37)
    got = embed(core, {"a": ids})["a"]
    ref = F.normalize(hidden(ids)[-1], dim=0)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # One chunk through SDPA, as transformers computes it: the same fp32 bits.
    assert torch.equal(got, ref)
    raw = embed(core, {"b": ids}, PoolingParams(normalize=False))["b"]
    assert torch.equal(raw, hidden(ids)[-1])
    assert abs(float(got.norm()) - 1.0) < 1e-6


def test_chunked_prompt_and_other_poolings(folder, hidden):
    """A prompt split over several steps (budget 16) pools the same as one chunk; mean and cls too."""
    core = engine(folder, max_num_batched_tokens=16)
    ids = prompt(2, 45)
    ref = hidden(ids)
    out = embed(core, {"last": ids}, PoolingParams(normalize=False))
    torch.testing.assert_close(out["last"], ref[-1], atol=1e-5, rtol=0)
    out = embed(core, {"mean": ids}, PoolingParams(pooling_type="mean"))
    torch.testing.assert_close(out["mean"], F.normalize(ref.mean(0), dim=0), atol=1e-5, rtol=0)
    out = embed(core, {"cls": ids}, PoolingParams(pooling_type="cls"))
    torch.testing.assert_close(out["cls"], F.normalize(ref[0], dim=0), atol=1e-5, rtol=0)


def test_batched_with_generation_and_no_kv_left(folder, hidden):
    """Embedding and generation requests in the same steps: the generated tokens are those of the
    engine alone, the vectors those of transformers, and afterwards every page is free (the
    embeddings' pages never reached the prefix cache; the generation's prompt did)."""
    gen_prompt = prompt(3, 21)
    params = SamplingParams(temperature=0, max_tokens=6)
    alone = engine(folder)
    alone.add_request("g", gen_prompt, params)
    expected = run_to_completion(alone)["g"]

    core = engine(folder)
    docs = {f"e{i}": prompt(10 + i, n) for i, n in enumerate((5, 19, 33))}
    core.add_request("g", gen_prompt, params)
    for rid, ids in docs.items():
        core.add_request(rid, ids, PoolingParams())
    mixed_steps = []
    pooled_step = core.runner.execute_pooled

    def spy(chunks):  # a forward with embedding chunks and a sampling chunk together
        mixed_steps.append(any(c.pooling_type for c in chunks) and any(c.sample for c in chunks))
        return pooled_step(chunks)

    core.runner.execute_pooled = spy
    tokens: dict[str, list[int]] = {}
    vectors = {}
    while core.has_unfinished():
        for out in core.step():
            if out.embedding is not None:
                vectors[out.request_id] = out.embedding
            else:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        core.check_integrity()
    assert tokens["g"] == expected
    for rid, ids in docs.items():
        torch.testing.assert_close(vectors[rid], F.normalize(hidden(ids)[-1], dim=0), atol=1e-6, rtol=0)
    assert any(mixed_steps)
    stats = core.stats()
    assert stats["kv_pages_in_use"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    # Only the generation request's full pages are cached: 21 + 6 - 1 computed tokens = 1 full page.
    assert stats["kv_pages_cached"] == (len(gen_prompt) + 6 - 1) // 16
    assert stats["pooling_requests_total"] == 3


def test_preempted_embedding_recomputes(folder, hidden):
    """A pool too small for everything: requests get preempted and recomputed, vectors stay exact."""
    core = build_engine_core(EngineConfig(model=str(folder), precision="exact", num_threads=1,
                                          kv_cache_tokens=64, max_num_batched_tokens=16))
    docs = {f"e{i}": prompt(20 + i, 40) for i in range(3)}
    core.add_request("g", prompt(30, 10), SamplingParams(temperature=0, max_tokens=30))
    vectors = {}
    for rid, ids in docs.items():
        core.add_request(rid, ids, PoolingParams())
    while core.has_unfinished():
        for out in core.step():
            if out.embedding is not None:
                vectors[out.request_id] = out.embedding
    assert core.scheduler.num_preemptions > 0
    for rid, ids in docs.items():
        torch.testing.assert_close(vectors[rid], F.normalize(hidden(ids)[-1], dim=0), atol=1e-6, rtol=0)


def test_bad_inputs_name_the_field(folder):
    core = engine(folder)
    with pytest.raises(InvalidRequest) as err:
        core.add_request("x", prompt(4, 600), PoolingParams())
    assert err.value.param == "input"
    with pytest.raises(InvalidRequest) as err:
        PoolingParams(pooling_type="max")
    assert err.value.param == "pooling_type"


def test_declared_pooling(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    assert declared_pooling(str(tmp_path)) == "mean"
    assert declared_pooling(str(tmp_path / "1_Pooling")) is None  # no modules.json: the engine pools the last token


def test_declared_pooling_of_a_gguf(tmp_path):
    import gguf

    for value, expected in ((gguf.PoolingType.MEAN, "mean"), (gguf.PoolingType.CLS, "cls"), (None, None)):
        path = tmp_path / f"m-{expected}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        if value is not None:
            writer.add_pooling_type(value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert declared_pooling(str(path)) == expected
