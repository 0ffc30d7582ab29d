"""A SentencePiece vocabulary from GGUF metadata (`tokenizer.ggml.model = "llama"`), tokenizing as
llama.cpp does (llama-vocab.cpp, `llm_tokenizer_spm_session`), as a `tokenizers.Tokenizer`.

llama.cpp's algorithm: spaces become U+2581, the text is split into characters, and the adjacent
pair whose concatenation is a vocabulary token with the highest score is merged, again and again
(ties: the leftmost pair); a piece left that is no token is spelled as its bytes (`<0xHH>`). A
byte-fallback BPE whose merges are every split of every token into two tokens, ranked by the whole
token's score, computes the same thing. Before that, the text is cut at the control, user-defined
and unknown tokens, which are emitted whole (Gemma's "\n", "\n\n", tab runs are user-defined):
added tokens, matched on the raw text. `add_space_prefix` prepends a space to every piece of text
that starts the prompt or follows such a token, as llama.cpp does.

transformers' GGUF converter builds a Unigram model for Gemma instead, whose ids differ from
llama.cpp's and from Gemma's own tokenizer; that is why this exists.
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, processors

# llama_token_type in GGUF metadata.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"


def build_spm_tokenizer(meta: dict[str, Any], tokens: list[str], scores: list[float], types: list[int]) -> tokenizers.Tokenizer:
    """`meta`: the GGUF tokenizer.* scalars; tokens, scores, token types: the vocabulary arrays."""
    vocab = {text: i for i, text in enumerate(tokens)}
    merges = _merges(tokens, scores, types, vocab)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=False,
                       unk_token=None if unk is None else tokens[int(unk)])
    tok = tokenizers.Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    pieces = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*pieces, decoders.Strip(" ", 1, 0)] if prefix else pieces)
    tok.add_tokens([tokenizers.AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == USER_DEFINED])
    tok.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)])
    tok.post_processor = _bos_eos(meta, tokens)
    return tok


def _merges(tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of every token into two tokens, best-scored result first."""
    ranked: list[tuple[float, int, str, str]] = []
    for i, text in enumerate(tokens):
        if types[i] == BYTE or len(text) < 2:
            continue
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                # Equal scores: the lower id first, then the longer left part (a stable order).
                ranked.append((-scores[i], i, left, right))
    ranked.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in ranked]


def _bos_eos(meta: dict[str, Any], tokens: list[str]) -> processors.TemplateProcessing | None:
    """BOS / EOS around an encoded prompt as the file's add_bos_token / add_eos_token say."""
    single, pair, special = "$A", "$A $B", []
    for key, default in (("bos", True), ("eos", False)):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None or not meta.get(f"tokenizer.ggml.add_{key}_token", default):
            continue
        text = tokens[int(token_id)]
        single = f"{text} {single}" if key == "bos" else f"{single} {text}"
        pair = f"{text} {pair}" if key == "bos" else f"{pair} {text}"
        special.append((text, int(token_id)))
    if not special:
        return None
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
