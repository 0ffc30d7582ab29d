"""`kv_cache_dtype` end to end on a tiny random-weight llama: int8 K/V give mostly the greedy tokens
bf16 K/V give, the prefix cache and preemption serve int8 rows as they serve bf16 ones (the same
tokens as a cold run with room to spare), stats say the dtype and its bytes, and exact mode refuses
int8 by the option's name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.fake_runner import run_to_completion
from tests.tiny_models import VOCAB_SIZE, make_tiny_model
from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.factory import build_engine_core
from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kvdtype"), "llama", tokenizer=False)


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(100, VOCAB_SIZE, (length,), generator=g)]


def engine(folder: Path, kv_cache_dtype: str, kv_cache_tokens: int = 1024, **kwargs) -> EngineCore:
    return build_engine_core(EngineConfig(model=str(folder), precision="fast", num_threads=1,
                                          kv_cache_tokens=kv_cache_tokens, kv_cache_dtype=kv_cache_dtype, **kwargs))


def greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int, tag: str = "") -> list[list[int]]:
    for i, ids in enumerate(prompts):
        core.add_request(f"{tag}{i}", ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    out = run_to_completion(core)
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


PROMPTS = [prompt(1, 5), prompt(2, 40), prompt(3, 23), prompt(4, 70)]


def test_int8_kv_agrees_with_bf16_kv_on_most_greedy_tokens(folder):
    bf16 = engine(folder, "bf16")
    int8 = engine(folder, "int8")
    assert bf16.runner.kv_caches[0][0].dtype == torch.bfloat16 and int8.runner.kv_caches[0][0].dtype == torch.int8
    a, b = greedy(bf16, PROMPTS, 24), greedy(int8, PROMPTS, 24)
    # greedy paths diverge for good after the first differing token: count the agreeing prefix
    same = sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b))
    assert same >= 0.75 * sum(len(p) for p in a), (a, b)
    s = int8.stats()
    c = int8.runner.model.config
    assert s["kv_cache_dtype"] == "int8" and bf16.stats()["kv_cache_dtype"] == "bf16"
    assert s["kv_cache_bytes_per_token"] == 2 * c.num_layers * c.num_kv_heads * (c.head_dim + 4)
    assert bf16.stats()["kv_cache_bytes_per_token"] == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
    int8.check_integrity()


def test_prefix_cache_and_preemption_serve_int8_rows(folder):
    shared = prompt(9, 48)  # three full pages shared by the requests below
    prompts = [shared + prompt(10 + i, 7) for i in range(3)]
    cold = [greedy(engine(folder, "int8"), [p], 16)[0] for p in prompts]  # each on a fresh engine
    warm = engine(folder, "int8")
    first = greedy(warm, prompts[:1], 16, "a")
    rest = greedy(warm, prompts[1:], 16, "b")
    assert warm.stats()["prefix_cache_hit_tokens_total"] >= 2 * 48
    assert first + rest == cold
    # A pool too small for all of them at once: requests are preempted and recomputed.
    small = engine(folder, "int8", kv_cache_tokens=7 * 16, max_num_seqs=4)
    assert greedy(small, prompts, 16, "c") == cold
    assert small.stats()["num_preemptions"] > 0
    small.check_integrity()


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_a_match_part_way_into_a_cached_page_computes_the_rest_only(folder, dtype):
    # The runner's page copy carries every tensor of a page (int8: codes and scales): a repeated
    # prompt computes its last token and a branch at token 30 the tokens after it, with the tokens
    # of a cold engine.
    p = prompt(20, 40)
    prompts = [p, p, p[:30] + prompt(21, 9)]
    cold = [greedy(engine(folder, dtype), [q], 12)[0] for q in prompts]
    warm = engine(folder, dtype)
    out = [greedy(warm, [q], 12, f"t{i}")[0] for i, q in enumerate(prompts)]
    assert out == cold
    assert warm.stats()["prefix_cache_hit_tokens_total"] == 39 + 30
    assert warm.prompt_tokens_computed_total == 40 + 1 + 9
    runner = warm.runner
    runner.copy_page(1, 7)
    for layer in runner.kv_caches:
        for t in layer:
            assert torch.equal(t[:, 7 * 16:8 * 16], t[:, 16:32])
    warm.check_integrity()


def test_exact_mode_refuses_int8_by_name():
    with pytest.raises(InvalidRequest, match="kv_cache_dtype") as err:
        EngineConfig(precision="exact", kv_cache_dtype="int8")
    assert err.value.param == "kv_cache_dtype"
    with pytest.raises(InvalidRequest, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    assert EngineConfig(precision="exact", kv_cache_dtype="bf16").kv_cache_dtype == "bf16"
    assert EngineConfig().kv_cache_dtype == "auto"


def test_metrics_say_the_dtype_and_bytes():
    from tokenmill.entrypoints.openai.metrics import ServerMetrics
    from tokenmill.ipc.messages import SchedulerStats

    stats = SchedulerStats(num_requests_running=0, num_requests_waiting=0, kv_pages_total=4, kv_pages_in_use=0,
                           prompt_tokens_total=0, generation_tokens_total=0, prefix_cache_hit_tokens_total=0,
                           num_preemptions=0, kv_cache_dtype="int8", kv_cache_bytes_per_token=12240)
    text = ServerMetrics(lambda: stats).render().decode()
    assert 'tokenmill:cache_config_info{cache_dtype="int8"} 1.0' in text
    assert "tokenmill:kv_cache_bytes_per_token 12240.0" in text


def test_a_pool_sized_in_bytes_holds_the_tokens_its_format_fits(folder):
    """`kv_cache_memory_bytes` (vLLM's --kv-cache-memory-bytes): the same bytes hold more tokens in int8
    than in bf16 (by the rows' widths), and the engine's kv_cache_tokens becomes what the bytes hold (kv_cache_tokens given
    beside it is replaced)."""
    nbytes = 3_000_000
    cores = {dtype: engine(folder, dtype, kv_cache_tokens=1024, kv_cache_memory_bytes=nbytes) for dtype in ("bf16", "int8")}
    pages = {}
    for dtype, core in cores.items():
        page_bytes = core.runner.kv_bytes_per_token * 16
        pages[dtype] = core.pool.num_pages
        assert pages[dtype] == nbytes // page_bytes == core.runner.num_pages
        assert core.config.kv_cache_tokens == pages[dtype] * 16 and core.stats()["kv_pages_total"] == pages[dtype]
        held = sum(t.numel() * t.element_size() for layer in core.runner.kv_caches for t in layer)
        assert nbytes - page_bytes < held <= nbytes, (dtype, held)
    hd = cores["int8"].runner.model.config.head_dim  # a row: 2 hd bytes in bf16, hd + a 4-byte scale in int8
    assert abs(pages["int8"] / pages["bf16"] - 2 * hd / (hd + 4)) < 0.01, (pages, hd)  # 1.88x at SmolLM2's 64
    assert greedy(cores["int8"], PROMPTS[:2], 8) == greedy(engine(folder, "int8", kv_cache_tokens=pages["int8"] * 16),
                                                            PROMPTS[:2], 8)
    cores["int8"].check_integrity()


def test_a_pool_too_small_for_one_page_is_refused_by_name(folder):
    with pytest.raises(InvalidRequest, match=r"kv_cache_memory_bytes 1000 holds no KV page: one page of 16 tokens "
                                             r"takes \d+ bytes in int8") as err:
        engine(folder, "int8", kv_cache_memory_bytes=1000)
    assert err.value.param == "kv_cache_memory_bytes"
    for bad in (0, -5, "1G", True, 1.5):
        with pytest.raises(InvalidRequest, match="kv_cache_memory_bytes must be an integer >= 1"):
            EngineConfig(kv_cache_memory_bytes=bad)


def test_byte_sizes_on_the_command_line():
    import argparse

    from tokenmill.entrypoints.engine_args import add_engine_args, byte_size, engine_kwargs

    # the same reading as --max-memory (frontend/model_router.py parse_memory): powers of 1024
    assert [byte_size(s) for s in ("1073741824", "2GiB", "500M", "1.5G", "3K")] == [
        2**30, 2 * 2**30, 500 * 2**20, 3 * 2**29, 3 * 1024]
    for bad in ("", "abc", "-1G", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--kv-cache-memory-bytes", "2GiB", "--kv-cache-disk-bytes", "20G"]))
    assert kwargs["kv_cache_memory_bytes"] == 2 * 2**30 and kwargs["kv_cache_disk_bytes"] == 20 * 2**30
    assert engine_kwargs(parser.parse_args([]))["kv_cache_memory_bytes"] is None
    assert EngineConfig(**engine_kwargs(parser.parse_args(["--kv-cache-memory-bytes", "1M"]))).kv_cache_memory_bytes == 2**20
