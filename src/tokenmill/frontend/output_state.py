"""What a request has produced so far, and what to send for it: text, stop strings, output modes.

One RequestOutputState per request (per sequence when n > 1). The engine calls update() with the
ids each step produced; the object is pure (no threads, no I/O), so nothing here ever waits for a
consumer, and a consumer that reads less often simply gets fewer, larger outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.stop_checker import StopChecker
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.sample.sampling_params import OutputKind, SamplingParams

FINISH_REASONS = frozenset({"stop", "length", "abort"})


@dataclass(frozen=True)
class OutputDelta:
    request_id: str
    text: str  # DELTA: new text since the last output; CUMULATIVE / FINAL_ONLY: all text
    token_ids: list[int]  # same rule as text
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None  # the stop string, or the stop_token_ids id that ended it; None for EOS
    num_output_tokens: int  # all tokens counted so far (the ones returned, in any mode)
    stop_hit: bool = False  # a stop string matched in this update: the engine must stop this request


class RequestOutputState:
    def __init__(
        self, request_id: str, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.request_id = request_id
        self.params = params
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        self._stops = StopChecker(params.stop_strings, params.include_stop_str_in_output)
        # As in vLLM, EOS is checked first: a stop on EOS has stop_reason None even if also listed.
        eos = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        self._stop_token_ids = frozenset(params.stop_token_ids or ()) - eos
        self._token_ids: list[int] = []
        self._chunks: list[str] = []  # all text released so far
        self._pending_text: list[str] = []  # released since the last output
        self._pending_tokens = 0  # tokens since the last output
        self._sent_any = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All text released so far (held-back text excluded until it is safe)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids)

    def update(self, new_token_ids: Sequence[int], finished_reason: str | None = None) -> OutputDelta | None:
        """Take one step's ids. finished_reason is the engine's view: "stop" means the LAST of
        new_token_ids is EOS or a stop_token_ids token; "length" / "abort" as usual.

        Returns what to send now, or None (nothing new, stream_interval not reached, final_only
        still running, or already finished)."""
        if self.finish_reason is not None:
            return None  # late ids after a stop string, or a second finish: nothing more to say
        if finished_reason is not None and finished_reason not in FINISH_REASONS:
            raise ValueError(
                f"finished_reason must be one of {sorted(FINISH_REASONS)}, got {finished_reason!r}"
            )
        ids = list(new_token_ids)
        stop_token = ids[-1] if finished_reason == "stop" and ids else None
        # vLLM's rule: the EOS / stop token is returned as an id but its text is not shown, unless
        # include_stop_str_in_output.
        show = ids if stop_token is None or self.params.include_stop_str_in_output else ids[:-1]
        stop_hit = self._consume(ids, len(show))
        if not stop_hit and finished_reason is not None:
            stop_hit = self._finish(finished_reason, stop_token)
        return self._output(stop_hit)

    def _consume(self, ids: list[int], n_show: int) -> bool:
        if not self._stops.has_stops:
            # No stop strings: one decode for the whole step.
            self._add_tokens(ids)
            self._release(self._detok.push(ids[:n_show]))
            return False
        # Token by token, so we know which token completed a stop string: later ones are dropped.
        for i, token_id in enumerate(ids):
            self._add_tokens([token_id])
            if i >= n_show:
                continue
            # min_tokens, as in vLLM (PR 22014): text of the first min_tokens tokens cannot complete a
            # stop string (such a match stays in the output); a match completed by a later token
            # counts even if it started in that early text.
            result = self._stops.feed(
                self._detok.push([token_id]), can_stop=len(self._token_ids) > self.params.min_tokens
            )
            self._release(result.text)
            if result.stopped:
                self.finish_reason, self.stop_reason = "stop", result.stop_reason
                return True
        return False

    def _finish(self, reason: str, stop_token: int | None) -> bool:
        # Text held back (an unfinished character, the start of a stop string) is released now; it may
        # still complete a stop string, which then wins as the reason.
        result = self._stops.feed(self._detok.flush(), can_stop=len(self._token_ids) > self.params.min_tokens)
        self._release(result.text)
        if result.stopped:
            self.finish_reason, self.stop_reason = "stop", result.stop_reason
            return True
        self._release(self._stops.flush())
        self.finish_reason = reason
        if stop_token is not None and stop_token in self._stop_token_ids:
            self.stop_reason = stop_token
        return False

    def _output(self, stop_hit: bool) -> OutputDelta | None:
        finished = self.finish_reason is not None
        kind = self.params.output_kind
        if not finished:
            if kind is OutputKind.FINAL_ONLY:
                return None
            if not self._pending_tokens and not self._pending_text:
                return None
            # The first output goes at once (time to first token); after it, every stream_interval tokens.
            if self._sent_any and self._pending_tokens < self.params.stream_interval:
                return None
        if kind is OutputKind.DELTA:
            text = "".join(self._pending_text)
            token_ids = self._token_ids[len(self._token_ids) - self._pending_tokens :]
        else:
            text, token_ids = self.text, list(self._token_ids)
        self._pending_text, self._pending_tokens, self._sent_any = [], 0, True
        return OutputDelta(
            request_id=self.request_id,
            text=text,
            token_ids=token_ids,
            finished=finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_output_tokens=len(self._token_ids),
            stop_hit=stop_hit,
        )

    def _add_tokens(self, ids: list[int]) -> None:
        self._token_ids.extend(ids)
        self._pending_tokens += len(ids)

    def _release(self, text: str) -> None:
        if text:
            self._chunks.append(text)
            self._pending_text.append(text)
