"""RequestOutputState: detokenizer + stop strings + output modes, on the bundled tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.frontend.output_state import OutputDelta, RequestOutputState
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.sample.sampling_params import OutputKind, SamplingParams

EOS = 2  # <|im_end|> in SmolLM2


def run(
    tok: Tokenizer, ids: list[int], steps: list[int] | None = None, finish: str | None = "length", **params
) -> list[OutputDelta]:
    """Feed ids in steps of the given sizes (default one token each), finishing on the last step."""
    state = RequestOutputState("r", tok, [1, 2, 3], SamplingParams(**params))
    outputs, i, k = [], 0, 0
    sizes = steps or [1]
    while i < len(ids):
        size = sizes[k % len(sizes)]
        last = i + size >= len(ids)
        out = state.update(ids[i : i + size], finish if last else None)
        if out is not None:
            outputs.append(out)
        i, k = i + size, k + 1
        if state.finished:
            break
    return outputs


def streamed_text(outputs: list[OutputDelta]) -> str:
    return "".join(o.text for o in outputs)


@pytest.mark.parametrize(
    ("stop", "expected_text", "n_tokens"),
    [
        ("lo wor", "Hel", 2),  # spans 'Hello' + ' world'
        ("world, th", "Hello ", 4),  # spans ' world' + ',' + ' this'
    ],
)
@pytest.mark.parametrize("steps", [[1], [3], [100]])
def test_stop_string_across_tokens(
    smol_tokenizer: Tokenizer, stop: str, expected_text: str, n_tokens: int, steps: list[int]
) -> None:
    ids = smol_tokenizer.encode("Hello world, this is great.")
    outputs = run(smol_tokenizer, ids, steps, finish=None, stop=[stop], output_kind=OutputKind.DELTA)
    final = outputs[-1]
    assert streamed_text(outputs) == expected_text
    assert (final.finished, final.finish_reason, final.stop_reason, final.stop_hit) == (
        True,
        "stop",
        stop,
        True,
    )
    # Tokens after the one that completed the stop string are neither counted nor returned.
    assert final.num_output_tokens == n_tokens
    assert [t for o in outputs for t in o.token_ids] == ids[:n_tokens]


def test_later_listed_stop_that_appears_first_wins(smol_tokenizer: Tokenizer) -> None:
    ids = smol_tokenizer.encode("Hello world, this is great.")
    final = run(smol_tokenizer, ids, [100], stop=["great", "this"])[-1]
    assert (final.text, final.stop_reason, final.num_output_tokens) == ("Hello world, ", "this", 4)


def test_stop_prefix_that_continues_differently_is_released(smol_tokenizer: Tokenizer) -> None:
    ids = smol_tokenizer.encode("hello world war")
    outputs = run(smol_tokenizer, ids, stop=["world peace"], output_kind=OutputKind.DELTA)
    assert [o.text for o in outputs] == ["hello", " ", "world war"]  # "world" held, then released
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("length", None)


@pytest.mark.parametrize(
    ("stop", "expected_text", "n_tokens"),
    [("好", "Say ", 4), ("好的", "Say ", 5), ("的 now", "Say 好", 6)],
)
def test_multibyte_stop_strings(
    smol_tokenizer: Tokenizer, stop: str, expected_text: str, n_tokens: int
) -> None:
    ids = smol_tokenizer.encode("Say 好的 now")  # 好 is three byte tokens
    outputs = run(smol_tokenizer, ids, stop=[stop], output_kind=OutputKind.DELTA)
    assert streamed_text(outputs) == expected_text
    assert outputs[-1].num_output_tokens == n_tokens
    assert "\ufffd" not in streamed_text(outputs)


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(smol_tokenizer: Tokenizer, include: bool) -> None:
    ids = smol_tokenizer.encode("The answer is 42. Done")
    outputs = run(
        smol_tokenizer, ids, stop=["42."], include_stop_str_in_output=include, output_kind=OutputKind.DELTA
    )
    expected = "The answer is 42." if include else "The answer is "
    assert streamed_text(outputs) == expected
    # At no point did the stream show part of a cut stop string.
    shown = ""
    for out in outputs:
        shown += out.text
        assert expected.startswith(shown)
    assert outputs[-1].num_output_tokens == 7


@pytest.mark.parametrize("steps", [[1], [2, 3], [100]])
def test_output_kinds_agree(smol_tokenizer: Tokenizer, steps: list[int]) -> None:
    ids = smol_tokenizer.encode("Say 好的 now, ok 🙂 bye. The answer is 42.")
    finals = {}
    for kind in OutputKind:
        outputs = run(smol_tokenizer, ids, steps, stop=["bye."], output_kind=kind)
        if kind is OutputKind.DELTA:
            finals[kind] = (streamed_text(outputs), [t for o in outputs for t in o.token_ids])
        else:
            finals[kind] = (outputs[-1].text, outputs[-1].token_ids)
        if kind is OutputKind.FINAL_ONLY:
            assert len(outputs) == 1 and outputs[0].finished
        if kind is OutputKind.CUMULATIVE:
            texts = [o.text for o in outputs]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert len(set(map(repr, finals.values()))) == 1
    assert finals[OutputKind.DELTA][0] == "Say 好的 now, ok 🙂 "


def test_stream_interval(smol_tokenizer: Tokenizer) -> None:
    ids = smol_tokenizer.encode("one two three four five six seven eight")
    assert len(ids) == 8
    outputs = run(smol_tokenizer, ids, stream_interval=3, output_kind=OutputKind.DELTA)
    # First token at once, then every 3 tokens, and always the final output.
    assert [len(o.token_ids) for o in outputs] == [1, 3, 3, 1]
    assert [o.num_output_tokens for o in outputs] == [1, 4, 7, 8]
    assert streamed_text(outputs) == "one two three four five six seven eight"
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])


def test_min_tokens_ignores_stops_completed_early(smol_tokenizer: Tokenizer) -> None:
    ids = smol_tokenizer.encode("Hello world, this is great.")
    # ' world' (token 2) would complete "world" but min_tokens=2 makes it not count; " is" completes later.
    final = run(smol_tokenizer, ids, stop=["world", " is"], min_tokens=2)[-1]
    assert (final.text, final.stop_reason, final.num_output_tokens) == ("Hello world, this", " is", 5)
    # A stop that starts in the first min_tokens tokens but completes after them counts (as in vLLM).
    final = run(smol_tokenizer, ids, stop=["world,"], min_tokens=2)[-1]
    assert (final.text, final.stop_reason, final.num_output_tokens) == ("Hello ", "world,", 3)


def test_eos_and_stop_tokens(smol_tokenizer: Tokenizer) -> None:
    ids = [*smol_tokenizer.encode("hi there"), EOS]
    final = run(smol_tokenizer, ids, [100], finish="stop", skip_special_tokens=False)[-1]
    # The EOS id is returned and counted, but its text is not shown (vLLM's rule).
    assert (final.text, final.token_ids, final.finish_reason, final.stop_reason) == (
        "hi there",
        ids,
        "stop",
        None,
    )
    assert final.num_output_tokens == len(ids) and not final.stop_hit
    stop_token = smol_tokenizer.encode(".")[0]
    ids = [*smol_tokenizer.encode("hi there"), stop_token]
    final = run(smol_tokenizer, ids, finish="stop", stop_token_ids=[stop_token])[-1]
    assert (final.text, final.stop_reason) == ("hi there", stop_token)
    final = run(
        smol_tokenizer, ids, finish="stop", stop_token_ids=[stop_token], include_stop_str_in_output=True
    )[-1]
    assert final.text == "hi there."


def test_length_finish_releases_held_text(smol_tokenizer: Tokenizer) -> None:
    ids = smol_tokenizer.encode("ok 好")[:-1]  # ends inside the character
    outputs = run(smol_tokenizer, ids, stop=["ok 好!"], output_kind=OutputKind.DELTA)
    assert streamed_text(outputs) == smol_tokenizer.decode(ids)  # as a one-shot decode shows it
    assert outputs[-1].finish_reason == "length"


def test_abort_and_late_updates(smol_tokenizer: Tokenizer) -> None:
    state = RequestOutputState("r", smol_tokenizer, [1], SamplingParams(stop=["zzz"]))
    first = state.update(smol_tokenizer.encode("hello zz"))
    assert first is not None and first.text == "hello "
    final = state.update([], "abort")
    assert final is not None and (final.text, final.finish_reason, final.finished) == (
        "hello zz",
        "abort",
        True,
    )
    assert state.update([5], None) is None
    assert state.update([], "length") is None


def test_nothing_new_gives_no_output(smol_tokenizer: Tokenizer) -> None:
    state = RequestOutputState("r", smol_tokenizer, [1], SamplingParams(output_kind=OutputKind.DELTA))
    assert state.update([]) is None
    with pytest.raises(ValueError):
        state.update([5], "eos")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.lists(
        st.sampled_from(["a", "b", " ", "好", "🙂", "é", "ab", " the"]), min_size=1, max_size=16
    ).map("".join),
    data=st.data(),
    steps=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_matches_one_shot_reference(
    smol_tokenizer: Tokenizer, text: str, data: st.DataObject, steps: list[int], include: bool
) -> None:
    ids = smol_tokenizer.encode(text)
    full = smol_tokenizer.decode(ids)
    starts = data.draw(st.lists(st.integers(0, len(full) - 1), min_size=1, max_size=2))
    stops = [full[s : s + data.draw(st.integers(1, 3))] for s in starts]
    # Reference: cut where a stop first completes; it was completed by the first token whose decoded
    # prefix (minus an unfinished character) reaches that far.
    found = [(full.find(s) + len(s), full.find(s), s) for s in stops]
    end, start, stop = min(found, key=lambda f: f[:2])
    for n in range(1, len(ids) + 1):
        prefix = smol_tokenizer.decode(ids[:n])
        if len(prefix) - prefix.endswith("\ufffd") >= end:
            break
    outputs = run(
        smol_tokenizer,
        ids,
        steps,
        stop=stops,
        include_stop_str_in_output=include,
        output_kind=OutputKind.DELTA,
    )
    assert streamed_text(outputs) == full[: end if include else start]
    assert [t for o in outputs for t in o.token_ids] == ids[:n]
    assert (outputs[-1].stop_reason, outputs[-1].finish_reason, outputs[-1].num_output_tokens) == (
        stop,
        "stop",
        n,
    )
