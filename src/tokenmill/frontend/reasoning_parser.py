"""Split a reasoning model's output into its thinking and its answer (`--reasoning-parser NAME`).

DeepSeek-R1 and Qwen3 write `<think>...</think>` before the answer. `ReasoningState` (one per
sequence) takes the output as it streams, text delta and token ids together, and returns each delta
split into a reasoning part and a content part. Text that may be the start of a marker is held back,
as stop strings are, so no cut `<think>` / `</think>` ever reaches either part whatever the token or
delta boundaries; the non-streaming answer is the same state fed all at once, so both agree.

The two parsers differ only in how the output may begin (vLLM's behaviour):
- `deepseek_r1`: everything before `</think>` is reasoning, with or without an opening `<think>`
  (DeepSeek-R1's template ends the prompt with `<think>\\n`, so the model never writes it).
- `qwen3`: reasoning only when the output starts with `<think>`; otherwise it is all content (e.g.
  `enable_thinking: false`, where the template already closed an empty thought in the prompt).
An output that ends before `</think>` is all reasoning (a thought cut by `max_tokens`). An output that
continues a final message (a prefill) starts where that text left off: in a thought it opened, else
in the answer.

`reasoning_tokens` counts output tokens up to and including the end marker's token(s): found in the
token ids where the marker's own ids appear, else (the model spelled it with other tokens) the
tokens received by the time the text showed the marker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class ReasoningParser:
    """How one model family marks its thinking; `new_state` makes the per-sequence state."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    start_optional: bool = False  # True: text before the end marker is reasoning even without `start`

    def new_state(self, end_ids: Sequence[int], prefill: str | None = None) -> ReasoningState:
        """`end_ids`: the end marker's token ids (encoded without special tokens), for the count.
        `prefill`: the final message's text that the output continues (None: the output opens a new
        turn); a continued output is thinking only where that text opened a thought and did not close
        it (Ollama's rule: the prompt ends with the opening tag), whatever the parser's own start."""
        state = ReasoningState(self, end_ids)
        if prefill is not None:
            state.continue_from(prefill.rfind(self.start) > prefill.rfind(self.end))
        return state


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", start_optional=True),
    "qwen3": ReasoningParser("qwen3"),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return parser


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class _Phase(Enum):
    START = "start"  # not yet known whether the output opens with the start marker
    REASONING = "reasoning"
    CONTENT = "content"


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker` (may still become it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningState:
    """One sequence's split; feed() every delta in order, then finish() once."""

    def __init__(self, parser: ReasoningParser, end_ids: Sequence[int]) -> None:
        self.parser = parser
        self._end_ids = list(end_ids)
        self._phase = _Phase.START
        self._held = ""
        self._token_ids: list[int] = []
        self._tokens_at_text_end: int | None = None  # tokens received when the text showed the end marker
        self._answer_only = False  # continues an answer: no output token is thinking

    def continue_from(self, in_thought: bool) -> None:
        """Starts inside a thought or inside the answer, as the text this output continues left off."""
        self._phase = _Phase.REASONING if in_thought else _Phase.CONTENT
        self._answer_only = not in_thought

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ReasoningDelta:
        self._token_ids.extend(token_ids)
        reasoning, content = self._split(self._held + text)
        return ReasoningDelta(reasoning, content)

    def finish(self) -> ReasoningDelta:
        """Releases held-back text: the output ended, so a cut marker is only text after all."""
        held, self._held = self._held, ""
        if self._phase is _Phase.START:
            self._phase = _Phase.REASONING if self.parser.start_optional else _Phase.CONTENT
        return ReasoningDelta(held, "") if self._phase is _Phase.REASONING else ReasoningDelta("", held)

    @property
    def reasoning_tokens(self) -> int:
        if self._answer_only:
            return 0
        if self._phase is _Phase.START and not self.parser.start_optional:
            return 0  # no start marker (yet): nothing counts as thinking
        if self._phase is not _Phase.CONTENT:
            return len(self._token_ids)
        end = self._end_in_ids()
        if end is not None:
            return end
        return self._tokens_at_text_end or 0  # 0: qwen3 output without a thought

    def _split(self, text: str) -> tuple[str, str]:
        self._held = ""
        if self._phase is _Phase.START:
            start = self.parser.start
            if text.startswith(start):
                self._phase, text = _Phase.REASONING, text[len(start):]
            elif start.startswith(text):
                self._held = text  # a cut start marker (or nothing yet): wait for more
                return "", ""
            else:
                self._phase = _Phase.REASONING if self.parser.start_optional else _Phase.CONTENT
        if self._phase is _Phase.CONTENT:
            return "", text
        end = self.parser.end
        at = text.find(end)
        if at >= 0:
            self._phase = _Phase.CONTENT
            self._tokens_at_text_end = len(self._token_ids)
            return text[:at], text[at + len(end):]
        keep = _held_suffix(text, end)
        if keep:
            self._held = text[-keep:]
        return text[: len(text) - keep], ""

    def _end_in_ids(self) -> int | None:
        """Tokens up to and including the first occurrence of the end marker's ids, if any."""
        ids, end = self._token_ids, self._end_ids
        n = len(end)
        if n == 0:
            return None
        for i in range(len(ids) - n + 1):
            if ids[i : i + n] == end:
                return i + n
        return None
