"""The raw bytes of single tokens, for the `bytes` of OpenAI logprobs.

Decoding one token as text loses what a token really is when it holds part of a UTF-8 character (a
byte-level BPE splits an emoji's 4 bytes over 2 or 3 tokens): the text decoder turns each piece into
U+FFFD. The bytes come from the vocabulary instead:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): every byte is stored as one printable character
  (GPT-2's `bytes_to_unicode` table); inverting the table gives the token's bytes exactly;
- SentencePiece with byte fallback (Llama 2, Mistral): `<0xHH>` pieces are one byte each, `▁` is a
  space, everything else is UTF-8 text;
- added tokens (special or not) are their own content, and any other vocabulary falls back to the
  decoded text.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

import tokenizers

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other 68 bytes
    are shifted to code points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _decoder_types(backend: tokenizers.Tokenizer) -> set[str]:
    decoder = backend.decoder
    if decoder is None:
        return set()
    state = json.loads(decoder.__getstate__())
    parts = state.get("decoders") or [state]  # a Sequence decoder lists its steps
    return {part.get("type", "") for part in parts if isinstance(part, dict)}


class TokenBytes:
    """token id -> its bytes; stateless after construction, cached per id."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self._added = {i: tok.content for i, tok in backend.get_added_tokens_decoder().items()}
        kinds = _decoder_types(backend)
        self._piece_bytes: Callable[[str], bytes | None]
        if "ByteLevel" in kinds:
            self._piece_bytes = _byte_level_bytes
        elif "ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds:
            self._piece_bytes = _sentencepiece_bytes
        else:
            self._piece_bytes = lambda piece: None
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._lookup(token_id)
        return cached

    def _lookup(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self._backend.id_to_token(token_id)
        raw = None if piece is None else self._piece_bytes(piece)
        if raw is None:  # an unknown vocabulary type: the decoded text is the best there is
            raw = self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return raw


def _byte_level_bytes(piece: str) -> bytes | None:
    table = _unicode_to_byte()
    try:
        return bytes(table[ch] for ch in piece)
    except KeyError:  # not a byte-level piece after all
        return None


def _sentencepiece_bytes(piece: str) -> bytes:
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace(_SPIECE_SPACE, " ").encode("utf-8")
