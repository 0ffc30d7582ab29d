"""The KV disk tier with real tensors (a tiny random-weight llama through the offline API): a prompt
whose prefix was evicted, or computed by an engine that has since shut down, is served from disk with
the same greedy tokens as when it was computed, in fp32 (exact) and bf16 (fast) caches alike."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill.entrypoints.llm import LLM
from tokenmill.sample.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(3, 3 + 150))  # 9 full pages of 16


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_prefix_from_disk_gives_the_same_tokens(tmp_path, precision):
    folder = str(make_tiny_model(tmp_path, "llama"))
    kw = dict(precision=precision, num_threads=1, kv_cache_tokens=1024, kv_cache_dir=str(tmp_path / "kv"))
    llm = LLM(folder, **kw)
    cold = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids
    assert llm.reset_prefix_cache()
    warm = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids
    stats = llm.stats()
    assert stats["kv_disk_hit_pages_total"] == 9 and warm == cold
    llm.shutdown()
    restarted = LLM(folder, **kw)
    again = restarted.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0]
    assert again.outputs[0].token_ids == cold
    assert restarted.stats()["kv_disk_hit_pages_total"] == 9 and again.num_cached_tokens == 9 * 16
    restarted.shutdown()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_pages_written_back_in_one_batch_read_as_they_were_read(tmp_path, dtype):
    """runner.write_pages puts each payload into its own page (any order, not adjacent) and no other."""
    folder = str(make_tiny_model(tmp_path, "llama"))
    llm = LLM(folder, precision="fast", num_threads=1, kv_cache_tokens=1024, kv_cache_dtype=dtype)
    llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)
    runner = getattr(llm.engine, "runner", None) or llm.engine.core.runner
    sources = [0, 3, 5, 8]  # pages the prompt filled
    payloads = [runner.read_page(p) for p in sources]
    assert len(set(payloads)) == len(sources)  # distinct contents, so a mix-up would show
    targets = [40, 21, 33, 22]
    untouched = {p: runner.read_page(p) for p in (20, 23, 34, 41)}
    runner.write_pages(targets, payloads)
    assert [runner.read_page(p) for p in targets] == payloads
    assert {p: runner.read_page(p) for p in untouched} == untouched
    with pytest.raises(ValueError, match="pages for"):
        runner.write_pages(targets[:2], payloads)
    llm.shutdown()
