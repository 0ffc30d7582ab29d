"""The prefix cache's disk tier in the engine (fake runner: a page's "K/V" are its tokens, and every
step checks that a sequence's pages hold exactly its tokens, so a page read back wrong fails here).
An evicted prefix comes back from disk instead of being recomputed, also in a new engine (a restart);
damaged files and other salts are recomputed; outputs never change."""

from __future__ import annotations

import pytest

from tests.engine.fake_runner import make_engine, reference_output, run_to_completion
from tokenmill.engine.kv_offload import build_offload
from tokenmill.sample.sampling_params import SamplingParams

PROMPT = [(i * 5) % 47 + 1 for i in range(100)]  # 6 full pages of 16, and 4 tokens


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)))
    return str(path)


def engine_with_tier(folder, model_file, **config):
    engine, runner = make_engine(kv_cache_tokens=512, page_size=16, **config)
    engine.attach_disk_tier(build_offload(str(folder), 1 << 20, runner, engine.pool, model_file, {"precision": "x"}))
    return engine


def ask(engine, rid, prompt, n=5, **kwargs):
    engine.add_request(rid, prompt, greedy(n), **kwargs)
    before = engine.prompt_tokens_computed_total
    out = run_to_completion(engine)[rid]
    assert out == reference_output(prompt, n)
    return engine.prompt_tokens_computed_total - before


def test_an_evicted_prefix_comes_back_from_disk(tmp_path, model_file):
    engine = engine_with_tier(tmp_path / "kv", model_file)
    assert ask(engine, "cold", PROMPT) == len(PROMPT)
    engine.scheduler.offload.tier.flush()
    assert engine.stats()["kv_disk_pages"] >= 6
    engine.scheduler.cache.evict_all()
    assert engine.stats()["kv_pages_cached"] == 0
    computed = ask(engine, "warm", PROMPT)
    assert computed == len(PROMPT) - 6 * 16  # 6 pages read back, the rest computed
    assert engine.stats()["kv_disk_hit_pages_total"] == 6
    engine.check_integrity()
    engine.shutdown()


def test_a_new_engine_finds_the_pages_of_the_last_one(tmp_path, model_file):
    first = engine_with_tier(tmp_path / "kv", model_file)
    ask(first, "a", PROMPT)
    first.shutdown()  # waits for the writes
    second = engine_with_tier(tmp_path / "kv", model_file)
    assert ask(second, "b", PROMPT + [9, 9]) == len(PROMPT) + 2 - 6 * 16
    second.shutdown()


def test_another_model_or_salt_never_reads_those_pages(tmp_path, model_file):
    first = engine_with_tier(tmp_path / "kv", model_file)
    ask(first, "a", PROMPT)
    first.shutdown()
    other_model = tmp_path / "other.gguf"
    other_model.write_bytes(b"GGUF" + bytes(range(255, -1, -1)))
    second = engine_with_tier(tmp_path / "kv", str(other_model))
    assert ask(second, "b", PROMPT) == len(PROMPT)
    second.shutdown()
    third = engine_with_tier(tmp_path / "kv", model_file)
    assert ask(third, "c", PROMPT, cache_salt="tenant") == len(PROMPT)
    assert ask(third, "d", [7] * 16 + PROMPT[16:]) == len(PROMPT)  # first page differs: no page matches
    third.shutdown()


def test_damaged_files_are_recomputed(tmp_path, model_file):
    engine = engine_with_tier(tmp_path / "kv", model_file)
    ask(engine, "a", PROMPT)
    engine.scheduler.offload.tier.flush()
    engine.scheduler.cache.evict_all()
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert len(files) >= 6
    for f in files:  # flip a byte in every page
        data = bytearray(f.read_bytes())
        data[-3] ^= 0x40
        f.write_bytes(bytes(data))
    assert ask(engine, "b", PROMPT) == len(PROMPT)
    assert engine.stats()["kv_disk_faults_total"] == 1  # the first bad page ends the disk match
    engine.check_integrity()
    engine.shutdown()


def test_under_pressure_the_tier_serves_pages_the_pool_evicted(tmp_path, model_file):
    engine, runner = make_engine(kv_cache_tokens=160, page_size=16)  # 10 pages
    engine.attach_disk_tier(build_offload(str(tmp_path / "kv"), 1 << 20, runner, engine.pool, model_file, {}))
    other = [(i * 3) % 41 + 2 for i in range(100)]
    ask(engine, "a", PROMPT)
    ask(engine, "b", other)  # evicts most of a's pages from the pool
    engine.scheduler.offload.tier.flush()
    assert ask(engine, "a again", PROMPT) < len(PROMPT) - 4 * 16
    engine.check_integrity()
    engine.shutdown()


def test_a_split_models_identity_covers_every_part(tmp_path):
    from tokenmill.engine.kv_offload import model_identity

    whole = tmp_path / "m.gguf"
    whole.write_bytes(b"GGUF" + bytes(100))
    parts = [tmp_path / f"s-{i:05d}-of-00002.gguf" for i in (1, 2)]
    for p in parts:
        p.write_bytes(b"GGUF" + bytes(100))
    split = model_identity(str(parts[0]), {})
    assert split != model_identity(str(whole), {})  # the second part counts
    parts[1].write_bytes(b"GGUF" + bytes(99) + b"\x01")  # only the second part changed
    assert model_identity(str(parts[0]), {}) != split
