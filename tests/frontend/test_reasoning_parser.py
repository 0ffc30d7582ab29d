"""ReasoningState on crafted outputs: the split must not depend on how the text is cut into deltas,
never show a cut marker, and count the thinking tokens."""

from __future__ import annotations

import pytest

from tokenmill.frontend.reasoning_parser import (
    REASONING_PARSERS,
    ReasoningDelta,
    ReasoningState,
    get_reasoning_parser,
)

END_ID = 99  # the end marker as one token, as Qwen3's and DeepSeek-R1's vocabularies have it


def state(name: str, end_ids: list[int] | None = None) -> ReasoningState:
    return get_reasoning_parser(name).new_state([END_ID] if end_ids is None else end_ids)


def run(st: ReasoningState, deltas: list[str]) -> tuple[list[ReasoningDelta], str, str]:
    parts = [st.feed(d) for d in deltas] + [st.finish()]
    return parts, "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


def every_split(text: str) -> list[list[str]]:
    """One character per delta, and every cut into two deltas."""
    return [list(text)] + [[text[:k], text[k:]] for k in range(len(text) + 1)]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_split_is_the_same_however_the_text_is_cut(name):
    text = "<think>Let me think: 2 + 2 < 5.</think>\n\nThe answer is 4."
    for deltas in every_split(text):
        # The joined fields hold no markup at all, so no part ever showed a piece of a marker.
        _, reasoning, content = run(state(name), deltas)
        assert (reasoning, content) == ("Let me think: 2 + 2 < 5.", "\n\nThe answer is 4."), deltas


def test_a_cut_end_marker_is_held_back_until_it_is_decided():
    st = state("qwen3")
    assert st.feed("<thi") == ReasoningDelta()
    assert st.feed("nk>hmm</th") == ReasoningDelta("hmm", "")
    assert st.feed("ink>") == ReasoningDelta("", "")
    assert st.feed("ok") == ReasoningDelta("", "ok")
    # Held text that turns out not to be a marker comes back in order.
    st = state("deepseek_r1")
    assert st.feed("a </th") == ReasoningDelta("a ", "")
    assert st.feed("x") == ReasoningDelta("</thx", "")


def test_no_end_marker_yet_is_all_reasoning_and_the_end_releases_held_text():
    st = state("deepseek_r1")
    parts, reasoning, content = run(st, ["<think>", "step one", " </thi"])
    assert parts[2] == ReasoningDelta(" ", "")  # the cut marker waits...
    assert (reasoning, content) == ("step one </thi", "")  # ...and is plain text once the output ends


def test_text_after_the_end_marker_is_content_even_if_it_looks_like_a_marker():
    _, reasoning, content = run(state("qwen3"), ["<think>r</think>", "a <think>b</think> c"])
    assert (reasoning, content) == ("r", "a <think>b</think> c")


def test_empty_reasoning():
    for name in REASONING_PARSERS:
        _, reasoning, content = run(state(name), ["<think></think>", "answer"])
        assert (reasoning, content) == ("", "answer")


def test_deepseek_r1_without_the_opening_marker():
    # DeepSeek-R1's template ends the prompt with "<think>\n": the output starts inside the thought.
    _, reasoning, content = run(state("deepseek_r1"), ["I should", " add.</", "think>4"])
    assert (reasoning, content) == ("I should add.", "4")
    # qwen3 needs the opening marker: without it everything is the answer.
    _, reasoning, content = run(state("qwen3"), ["I should", " add.</", "think>4"])
    assert (reasoning, content) == ("", "I should add.</think>4")


def test_reasoning_tokens_count_up_to_and_including_the_end_marker_token():
    st = state("qwen3")
    st.feed("<think>a b", [1, 2, 3])
    assert st.reasoning_tokens == 3  # no end yet: every token so far is thinking
    st.feed("</think>answer", [END_ID, 7, 8])
    st.finish()
    assert st.reasoning_tokens == 4
    st = state("qwen3")
    st.feed("plain answer", [5, 6])
    st.finish()
    assert st.reasoning_tokens == 0
    st = state("deepseek_r1")
    st.feed("thought", [5, 6])
    st.finish()
    assert st.reasoning_tokens == 2  # cut before the end marker: all thinking


def test_reasoning_tokens_find_a_multi_token_end_marker_or_fall_back_to_the_text():
    st = state("deepseek_r1", end_ids=[40, 41, 42])
    for text, ids in [("x </", [1, 40]), ("think", [41]), (">", [42]), ("y", [2])]:
        st.feed(text, ids)
    assert st.reasoning_tokens == 4
    # The model spelled the marker with other tokens: count what had arrived when the text showed it.
    st = state("deepseek_r1", end_ids=[40, 41, 42])
    for text, ids in [("x", [1]), ("</think>", [50, 51]), ("y z", [2, 3])]:
        st.feed(text, ids)
    assert st.reasoning_tokens == 3


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; known: deepseek_r1, qwen3"):
        get_reasoning_parser("r2")


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize(("prefill", "in_thought"), [
    ("The capital of France is", False),  # an answer's start: DeepSeek-R1's parser too reads an answer
    ("<think>", True),
    ("<think>\nLet me see,", True),
    ("<think>Checked.</think>So", False),
])
def test_a_continued_output_starts_where_its_prefill_left_off(name, prefill, in_thought):
    st = get_reasoning_parser(name).new_state([END_ID], prefill)
    _, reasoning, content = run(st, [" more", " text</think>", " answer"] if in_thought else [" Paris."])
    if in_thought:
        assert (reasoning, content) == (" more text", " answer")
    else:
        assert (reasoning, content, st.reasoning_tokens) == ("", " Paris.", 0)
