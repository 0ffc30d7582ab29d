"""Turn a stream of generated token ids into a stream of text, one small decode per step.

Contract: the concatenation of everything push() and flush() return equals
`tokenizer.decode(all_pushed_ids, skip_special_tokens)`, and no chunk ends in half a character:
text is held only from an unfinished character (a trailing U+FFFD run in the decode) onwards.

Why not `tokenizers.decoders.DecodeStream`: it holds text ending in U+FFFD with no way to get it
back (the end of a stream that stops mid-character is lost, so the contract breaks), it holds
*forever* while invalid bytes keep coming (each step then re-decodes an ever longer window), and its
state cannot be read to fix either. So this is vLLM's prefix/read-offset scheme, with a flush and a
bound on how long text is held.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.frontend.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what decode() prints for bytes that are not (yet) valid UTF-8
# A character has at most 4 UTF-8 bytes, so at most 3 of them can be waiting for the rest, and
# byte-level tokens carry at least one byte each: the pending bytes lie in the last 3 tokens.
_TAIL_TOKENS = 3
# After this many tokens without completing the text, the bytes are invalid rather than pending:
# release all but the last character, so a flood of bad bytes costs O(1) per step and shows up.
_MAX_PENDING = 6


class IncrementalDetokenizer:
    """Per request. Not thread-safe; cheap: each step decodes only a window of a few tokens.

    prompt_token_ids is accepted but not used as decoding context, on purpose: the text must equal
    decode(output ids) alone. With the prompt as context, SentencePiece-style tokenizers would start
    the output with the space their decoder strips at the start of a text, and a prompt ending
    mid-character would change the first output characters.

    spaces_between_special_tokens has no effect: tokenizers (and transformers 5 on top of it) puts
    added tokens into the text as they are, never with spaces around them, for every decoder LLMs use.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Skipped tokens never reach the window: they add no text, so they must not use up context.
        self._skipped = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # ids that can produce text
        self._prefix = 0  # window start: decode(ids[prefix:]) is what each step looks at
        self._read = 0  # ids before this have all their text emitted
        self._emitted = 0  # characters of decode(ids[prefix:]) already returned
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text returned so far (joined lazily, so streaming in delta mode never pays for it)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, token_ids: Iterable[int]) -> str:
        """Add generated ids; return the text that is new and final ('' while a character is incomplete)."""
        before = len(self._ids)
        self._ids.extend(t for t in token_ids if t not in self._skipped)
        if len(self._ids) == before:
            return ""
        return self._record(self._step())

    def flush(self) -> str:
        """At the end of the request: release held text as decode() shows it (an unfinished character
        becomes U+FFFD, as in a one-shot decode). Only call it when no more ids will come."""
        window = self._decode(self._ids[self._prefix :])
        new = window[self._emitted :]
        self._read, self._emitted = len(self._ids), max(self._emitted, len(window))
        return self._record(new)

    def _step(self) -> str:
        window = self._decode(self._ids[self._prefix :])
        pending = len(self._ids) - self._read
        if window.endswith(_REPLACEMENT):
            if pending > _MAX_PENDING:
                return self._release_invalid(window)
            # A character split across tokens: hold it until its last byte comes, but what precedes it
            # is final already (a stop string there must be seen now, at the token that completed it).
            stable = len(window.rstrip(_REPLACEMENT))
            if stable <= self._emitted:
                return ""
            new = window[self._emitted : stable]
            self._emitted = stable
            return new
        if len(window) <= self._emitted and pending <= _MAX_PENDING:
            # No text yet (e.g. a token that decodes to nothing): keep the window, it holds the context
            # a decoder may need for the next token (SentencePiece strips a leading space otherwise).
            return ""
        new = window[self._emitted :]
        self._advance(window)
        return new

    def _advance(self, window: str) -> None:
        # Keep the ids of the last emission as left context, as vLLM does: decoders like SentencePiece
        # render a token differently at the start of a text.
        old_prefix = self._prefix
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix == old_prefix:
            self._emitted = len(window)
        else:
            self._emitted = len(self._decode(self._ids[self._prefix :]))

    def _release_invalid(self, window: str) -> str:
        # Lossy UTF-8 decoding renders an incomplete tail as exactly one final U+FFFD, and no later byte
        # can change what comes before it: everything but the last character is final.
        anchor = len(self._ids) - _TAIL_TOKENS
        tail = self._decode(self._ids[anchor:])
        if not tail.endswith(_REPLACEMENT):  # not a byte-concatenating decoder: stop waiting altogether
            new = window[self._emitted :]
            self._advance(window)
            return new
        new = window[self._emitted : -1]
        # Restart the window on the last tokens, which hold the pending bytes; its leading characters
        # may differ from the full text (a cut character) but they count as already emitted.
        self._prefix = self._read = anchor
        self._emitted = len(tail) - 1
        return new

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _record(self, new: str) -> str:
        if new:
            self._chunks.append(new)
        return new
