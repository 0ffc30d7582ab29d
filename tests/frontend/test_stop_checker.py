"""StopChecker on plain text deltas (the token-level behaviour is tested in test_output_state)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.frontend.stop_checker import StopChecker


def feed_all(checker: StopChecker, deltas: list[str]) -> tuple[str, list[str], str | None]:
    shown: list[str] = []
    for delta in deltas:
        result = checker.feed(delta)
        shown.append(result.text)
        if result.stopped:
            return "".join(shown), shown, result.stop_reason
    shown.append(checker.flush())
    return "".join(shown), shown, None


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Stop where a stop string first completes; on a tie, the one starting first."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found, key=lambda f: f[:2])
    return text[: end if include else start], stop


def test_stop_split_across_deltas_is_cut() -> None:
    text, shown, reason = feed_all(StopChecker(["STOP"]), ["abc S", "TO", "P and more"])
    assert (text, reason) == ("abc ", "STOP")
    assert shown == ["abc ", "", ""]  # "S" and "STO" are held, never shown


def test_include_stop_str_in_output() -> None:
    text, shown, reason = feed_all(
        StopChecker(["STOP"], include_stop_str_in_output=True), ["abc S", "TO", "P tail"]
    )
    assert (text, reason) == ("abc STOP", "STOP")
    assert shown == ["abc S", "TO", "P"]  # nothing to hold back: the stop string is shown anyway


def test_earliest_match_wins_over_list_order() -> None:
    # Both complete in one delta; "world" is listed first but "lo" appears first.
    assert feed_all(StopChecker(["world", "lo"]), ["hello world"])[::2] == ("hel", "lo")
    # Overlapping: "bc" completes before "abcd" does, so it wins however the text is cut.
    for deltas in (["abcd"], ["ab", "cd"], ["a", "b", "c", "d"]):
        assert feed_all(StopChecker(["abcd", "bc"]), deltas)[::2] == ("a", "bc")
    # Same end: the longer one (starting first) wins.
    assert feed_all(StopChecker(["c", "abc"]), ["xabc"])[::2] == ("x", "abc")


def test_prefix_that_continues_differently_is_released() -> None:
    checker = StopChecker(["world peace"])
    assert checker.feed("hello wor").text == "hello "
    assert checker.held_text == "wor"
    result = checker.feed("ld war")
    assert (result.text, result.stopped) == ("world war", False)
    assert checker.feed("!").text == "!"


def test_multibyte_stop_strings() -> None:
    assert feed_all(StopChecker(["好的", "🙂"]), ["你", "好", "的吗"])[::2] == ("你", "好的")
    assert feed_all(StopChecker(["好的", "🙂"]), ["ok 🙂 no"])[::2] == ("ok ", "🙂")
    assert feed_all(StopChecker(["e\u0301x"]), ["cafe", "\u0301", "x!"])[::2] == ("caf", "e\u0301x")


def test_flush_releases_held_text() -> None:
    checker = StopChecker(["</answer>"])
    assert checker.feed("42 </ans").text == "42 "
    assert checker.flush() == "</ans"
    assert checker.flush() == ""


def test_hold_back_is_bounded() -> None:
    checker = StopChecker(["abcdef", "xyz"])
    checker.feed("zzzzabcde")
    assert checker.held_text == "abcde"  # at most max(len(stop)) - 1 characters


def test_can_stop_false_ignores_matches_completed_in_that_text() -> None:
    checker = StopChecker(["ab"])
    assert checker.feed("xab a", can_stop=False).text == "xab "
    # A match that starts in unchecked text but completes later does count (as in vLLM).
    result = checker.feed("b")
    assert (result.text, result.stopped, result.stop_reason) == ("", True, "ab")


def test_no_stops_passes_text_through() -> None:
    checker = StopChecker([])
    assert checker.feed("anything").text == "anything"
    assert checker.flush() == ""


def test_after_stop_nothing_more() -> None:
    checker = StopChecker(["x"])
    assert checker.feed("axb").stopped
    late = checker.feed("more")
    assert (late.text, late.stopped, late.stop_reason) == ("", True, "x")
    assert checker.flush() == ""


_SMALL = st.text(alphabet="abc ", min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=40),
    stops=st.lists(_SMALL, min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=12),
    include=st.booleans(),
)
def test_any_chunking_gives_the_reference_result(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    expected, expected_stop = reference(text, stops, include)
    checker = StopChecker(stops, include)
    shown = ""
    for delta in deltas:
        result = checker.feed(delta)
        shown += result.text
        # Never past the stop and never any part of a cut stop string, at every step.
        assert expected.startswith(shown)
        assert len(checker.held_text) <= max(map(len, stops)) - 1
        if result.stopped:
            break
    else:
        shown += checker.flush()
    assert shown == expected
    assert checker.stop_reason == expected_stop


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab ", max_size=30), stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=6),
                                                                  min_size=1, max_size=3))
def test_holds_back_exactly_the_longest_pending_prefix(text: str, stops: list[str]) -> None:
    checker = StopChecker(stops)
    if checker.feed(text).stopped:
        return
    pending = [k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])]
    assert checker.held_text == text[len(text) - max(pending, default=0):]


def test_a_long_stop_string_costs_memory_linear_in_its_length() -> None:
    # Every prefix of a 400,000-character stop string kept in a set was ~80 GB: the detokenizer died.
    import tracemalloc

    tracemalloc.start()
    checker = StopChecker(["x" * 400_000 + "!"])
    shown = "".join(checker.feed("x" * 50).text for _ in range(20))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert shown == "" and len(checker.held_text) == 1000  # all of it may still become the stop
    assert peak < 20 * 400_000  # a few copies of the string at most
    assert checker.feed("y").text == "x" * 1000 + "y"
