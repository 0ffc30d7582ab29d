"""The offline API on the bundled model: inputs, outputs, errors, and that nothing leaks."""

from __future__ import annotations

import pytest

from tests.real_model import make_llm
from tokenmill.errors import InvalidRequest, ModelLoadError
from tokenmill.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return make_llm(kv_cache_tokens=4096)


def greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def test_text_and_token_id_prompts_give_the_same_completion(llm):
    text = "The three primary colours are"
    ids = llm.tokenizer.encode(text)
    by_text, by_ids, by_dict = llm.generate([text, ids, {"prompt_token_ids": ids}], greedy(ignore_eos=True))
    assert by_text.prompt == text and by_text.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    out = by_text.outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert by_text.num_prompt_tokens == len(ids) and by_text.num_completion_tokens == 8


def test_chat_uses_the_model_template_and_stops_at_eos(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], greedy(64))[0]
    assert out.prompt_token_ids == llm.chat_prompt_ids([{"role": "user", "content": "Say hello."}])
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> well before 64 tokens
    assert "<|im_end|>" not in out.outputs[0].text and out.outputs[0].text.strip()


def test_stop_string_cuts_the_text_and_ends_the_request(llm):
    result = llm.generate("1, 2, 3, 4, 5,", greedy(16, ignore_eos=True))[0]
    full = result.outputs[0]
    assert " 7," in full.text
    # where the request spent its time (engine/timeline.py), ended by the engine or by a stop string
    assert result.metrics["num_output_tokens"] == 16 and result.metrics["events"][-1]["reason"] == "length"
    stopped = llm.generate("1, 2, 3, 4, 5,", greedy(16, ignore_eos=True, stop=[" 7,"]))[0]
    out = stopped.outputs[0]
    assert stopped.metrics["events"][-1]["reason"] == "stop" and stopped.metrics["first_token_latency"] > 0
    assert out.finish_reason == "stop" and out.stop_reason == " 7,"
    assert out.text == full.text[: full.text.index(" 7,")]
    assert len(out.token_ids) < 16
    assert llm.stats()["kv_pages_in_use"] == 0


def test_n_samples_with_a_seed_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate("Once upon a time", params)[0]
    b = llm.generate(["Once upon a time", "Unrelated other prompt"], params)[0]
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_n4_prefills_the_prompt_once_and_is_reproducible(llm):
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)  # 51 tokens
    llm.reset_prefix_cache()
    before = llm.stats()["prompt_tokens_computed_total"]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": ids}, params)[0]
    computed = llm.stats()["prompt_tokens_computed_total"] - before
    # One prefill; each other sample recomputes only the prompt's last partial page (16-token pages).
    assert computed == len(ids) + 3 * (len(ids) - (len(ids) - 1) // 16 * 16)
    assert computed <= len(ids) + 3 * 16
    assert first.num_cached_tokens == 0  # the samples sharing each other's prefill is not a cache hit
    assert len(first.outputs) == 4 and all(len(o.token_ids) == 8 for o in first.outputs)
    again = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]


def test_stats_and_integrity_after_work(llm):
    llm.generate(["a b c", "d e f"], greedy(4))
    stats = llm.stats()
    for key in ("kv_pages_total", "kv_pages_free", "kv_pages_in_use"):
        assert key in stats
    assert stats["kv_pages_total"] == 4096 // 16 and stats["kv_pages_in_use"] == 0
    # Finished requests' pages are either free or kept by the prefix cache, never lost.
    assert stats["kv_pages_free"] + stats.get("kv_pages_cached", 0) == stats["kv_pages_total"]
    llm.check_integrity()


def test_progress_bar_for_large_batches(llm, capsys):
    llm.generate(["x"] * 16, greedy(1))
    assert "generating" in capsys.readouterr().err
    llm.generate(["x"] * 2, greedy(1))
    assert "generating" not in capsys.readouterr().err


def test_stream_yields_the_same_text_piecewise(llm):
    pieces = list(llm.stream("The capital of France is", greedy(12, ignore_eos=True)))
    full = llm.generate("The capital of France is", greedy(12, ignore_eos=True))[0].outputs[0].text
    assert len(pieces) > 1 and "".join(pieces) == full
    assert llm.stats()["kv_pages_in_use"] == 0


@pytest.mark.parametrize(
    "make_params,param",
    [
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0), "top_p"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(top_k=-5), "top_k"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(make_params, param):
    with pytest.raises(InvalidRequest) as e:
        make_params()
    assert e.value.param == param and param in str(e.value)


def test_bad_requests_are_rejected_and_leave_the_engine_working(llm):
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate({"prompt_token_ids": []}, greedy())
    with pytest.raises(InvalidRequest, match="context length"):
        llm.generate("hi", greedy(9000))
    with pytest.raises(InvalidRequest, match="KV cache"):
        llm.generate("hi", greedy(5000))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, greedy())
    with pytest.raises(InvalidRequest, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias={10**6: 1.0}))
    assert llm.stats()["kv_pages_in_use"] == 0
    assert llm.generate("hi", greedy(2))[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda llm: llm.generate(5), "prompts"),
        (lambda llm: llm.generate("hi", {"temperature": 0}), "sampling_params"),
        (lambda llm: llm.generate({"prompt_token_ids": [504.9, 3575.2]}), "prompt_token_ids"),
        (lambda llm: llm.generate({"prompt_token_ids": [True, 3575]}), "prompt_token_ids"),
        (lambda llm: llm.generate({"prompt": None}), "prompt"),
        (lambda llm: llm.generate("caf\udce9"), "prompt"),  # a byte that was not UTF-8, as Python escapes it
        (lambda llm: llm.chat([{"role": "user", "content": "hi \ud800"}]), "prompt"),
    ],
)
def test_inputs_of_the_wrong_kind_are_refused_naming_them(llm, call, param):
    with pytest.raises(InvalidRequest) as err:
        call(llm)
    assert err.value.param == param
    assert llm.stats()["kv_pages_in_use"] == 0


def test_two_threads_share_one_llm_one_call_at_a_time(llm):
    import threading

    prompts = ["The capital of France is", "1, 2, 3,"]
    expected = [o.outputs[0].text for o in llm.generate(prompts, greedy(6, ignore_eos=True))]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            got[i] = llm.generate(prompts[i], greedy(6, ignore_eos=True))[0].outputs[0].text
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and [got[0], got[1]] == expected
    # Inside an unfinished stream, this thread's next call would wait for itself: refused instead.
    stream = llm.stream("Once upon a time", greedy(8, ignore_eos=True))
    next(stream)
    with pytest.raises(RuntimeError, match="already inside a call"):
        llm.generate("hi", greedy(2))
    stream.close()
    assert llm.stats()["kv_pages_in_use"] == 0 and llm.generate("hi", greedy(2))[0].outputs[0].text


def test_a_shut_down_llm_says_so():
    llm = make_llm(kv_cache_tokens=256)
    with llm:
        assert llm.generate("hi", greedy(2))[0].outputs[0].text
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("hi", greedy(2))


def test_bad_engine_arguments_and_model_paths(tmp_path):
    with pytest.raises(InvalidRequest, match="kv_cache_tokens"):
        make_llm(kv_cache_tokens=0)
    with pytest.raises(InvalidRequest, match="unknown engine argument"):
        make_llm(kv_cache_token=10)
    for name, value in (("num_threads", -1), ("num_threads", 1.5), ("max_model_len", 2.5), ("seed", "x")):
        with pytest.raises(InvalidRequest, match=name):
            make_llm(**{name: value})
    with pytest.raises(InvalidRequest, match="kv_cache_dir .* is not a folder"):
        make_llm(kv_cache_dir=__file__)
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        make_llm(model=str(missing))


def test_cached_tokens_are_reported_for_a_repeated_prompt(llm):
    prompt = " ".join(["word"] * 100)
    first = llm.generate(prompt, greedy(2))[0]
    second = llm.generate(prompt, greedy(2))[0]
    assert first.num_cached_tokens == 0 or first.num_cached_tokens < second.num_cached_tokens
    # Page-aligned, and the last prompt token is always recomputed.
    assert second.num_cached_tokens == (len(second.prompt_token_ids) - 1) // 16 * 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache() and llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def test_embed_returns_one_unit_vector_per_prompt(llm):
    text = "Paris is the capital of France."
    ids = llm.tokenizer.encode(text)
    cached_before = llm.stats()["kv_pages_cached"]
    a, b, c = llm.embed([text, ids, "A completely different sentence about cooking."])
    assert len(a) == llm.engine.runner.model.config.hidden_size
    assert a == b  # the same prompt as text or ids, alone or batched: the same vector
    assert abs(sum(x * x for x in a) - 1.0) < 1e-4 and a != c
    # alone: another batch shape, so fast mode's kernels may round differently in the last bits
    assert max(abs(x - y) for x, y in zip(llm.embed(text)[0], a)) < 1e-4
    stats = llm.stats()
    assert stats["kv_pages_in_use"] == 0 and stats["kv_pages_cached"] == cached_before  # nothing kept
