"""A lower bound on a text's token count that needs no tokenization: len(text) / L, where L is the
most characters one token can stand for, computed once from the tokenizer's own definition.

Why: tokenizing a multi-megabyte prompt takes seconds and memory, only for the length check to reject
it afterwards. With the bound, a prompt that is certainly too long is rejected in O(1) (issue 15).

Why it is a lower bound (for the pipelines accepted below; any other gives no bound, so no check):
- Added tokens (special or not) are cut out of the text first and each stands for exactly its
  content's characters, unless it strips whitespace around it (lstrip/rstrip: then it could swallow
  any number of spaces), which disables the bound.
- The normalizer may only lengthen the text: none, Prepend, Replace of a plain string by one at least
  as long (SentencePiece's " " -> "▁"). NFC/NFKC can compose several characters into one: no bound.
- The pre-tokenizer may only split or lengthen, never drop: ByteLevel (each character becomes its
  1-4 UTF-8 bytes, one vocabulary character per byte), Metaspace, Split/Punctuation that keep the
  matches, Digits. Whitespace-dropping ones (BERT's) give no bound.
- The model is BPE: a token's vocabulary string is the concatenation of the pieces it merged (plus
  an optional subword prefix/suffix, which only makes the string longer than what it covers), a
  byte-fallback token covers one byte, an unknown character becomes one `unk` token... unless unks are
  fused (`fuse_unk`: one token for a whole run), which disables the bound. No truncation.
So every token covers at most L characters of a text at least as long as the input, hence
tokens >= ceil(len(text) / L). The post-processor (BOS, EOS) only adds tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import tokenizers

_LENGTHENING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


def max_chars_per_token(backend: tokenizers.Tokenizer) -> int | None:
    """L, the most characters of input one token can cover; None when no such bound is provable."""
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("fuse_unk") or spec.get("truncation") is not None:
        return None
    if not _lengthens(spec.get("normalizer")) or not _keeps_all(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(tok.get("lstrip") or tok.get("rstrip") for tok in added):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    longest = max((len(token) for token in vocab), default=1)
    return max(longest, 1)


def min_token_count(text: str, max_chars: int | None) -> int:
    """A number never above len(encode(text)) (any add_special_tokens); 0 when there is no bound."""
    if max_chars is None or not text:
        return 0
    return -(-len(text) // max_chars)


def _lengthens(normalizer: dict[str, Any] | None) -> bool:
    return _every(normalizer, "normalizers", _lengthening_normalizer)


def _keeps_all(pre_tokenizer: dict[str, Any] | None) -> bool:
    return _every(pre_tokenizer, "pretokenizers", _keeping_pre_tokenizer)


def _every(node: dict[str, Any] | None, key: str, allowed: Callable[[dict[str, Any]], bool]) -> bool:
    """True if the pipeline step (none, one, or a Sequence of them under `key`) is all allowed."""
    if node is None:
        return True
    if node.get("type") == "Sequence":
        return all(_every(child, key, allowed) for child in node.get(key, []))
    return allowed(node)


def _lengthening_normalizer(normalizer: dict[str, Any]) -> bool:
    kind = normalizer.get("type")
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        return "String" in pattern and len(normalizer.get("content", "")) >= len(pattern["String"])
    return False


def _keeping_pre_tokenizer(pre_tokenizer: dict[str, Any]) -> bool:
    kind = pre_tokenizer.get("type")
    if kind in ("Split", "Punctuation") and pre_tokenizer.get("behavior") == "Removed":
        return False
    return kind in _LENGTHENING_PRE_TOKENIZERS
