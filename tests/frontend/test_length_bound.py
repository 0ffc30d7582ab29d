"""The untokenized length bound (issue 15): never above the real token count, on the bundled byte-level
BPE and on a SentencePiece-style (Metaspace) BPE, and absent for pipelines where it cannot be proven."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from tokenmill.frontend.length_bound import max_chars_per_token, min_token_count
from tokenmill.frontend.tokenizer import Tokenizer as TmTokenizer

# Pieces chosen to hit the long tokens (runs of spaces, '#', '-', newlines + indentation), special
# tokens written as text, multi-byte characters and invalid-looking mixes.
PIECES = [" ", "    ", "\n", "\n        ", "#" * 80, "-" * 64, "=" * 70, "<|im_start|>", "<|endoftext|>",
          "hello", " world", "é", "日本語", "🙂", "\u0301", "\t", "0123456789", "abc" * 10, "ĠĠ", "<0x41>"]


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 60)):
            if rng.random() < 0.2:
                parts.append("".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 8))))
            else:
                parts.append(rng.choice(PIECES) * rng.randint(1, 5))
        texts.append("".join(parts))
    return texts


def test_bundled_bound_never_exceeds_the_token_count(smol_tokenizer: TmTokenizer) -> None:
    longest = max_chars_per_token(smol_tokenizer.backend)
    assert longest is not None and longest >= 64  # byte-level: runs of 64+ spaces or '#' are one token
    tight = 0
    for text in random_texts(0, 400):
        count = len(smol_tokenizer.encode(text, add_special_tokens=False))
        bound = smol_tokenizer.min_token_count(text)
        assert 1 <= bound <= count, (text, bound, count)
        tight += bound * 4 >= count
    # Long runs of the longest tokens' characters come close to it (50 against 63 tokens).
    worst = "#" * 80 * 50
    assert 50 == smol_tokenizer.min_token_count(worst) <= len(smol_tokenizer.encode(worst)) < 100
    assert tight > 0  # not vacuous: some random texts come within 4x of it


def _metaspace_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>"],
                                  initial_alphabet=[f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator(random_texts(1, 200), trainer)
    return tok


def test_metaspace_bound_never_exceeds_the_token_count() -> None:
    tok = _metaspace_bpe()
    longest = max_chars_per_token(tok)
    assert longest is not None
    for text in random_texts(2, 300):
        assert min_token_count(text, longest) <= len(tok.encode(text).ids), text


@pytest.mark.parametrize("spoil", ["nfc", "fuse_unk", "lstrip", "whitespace", "truncation", "wordlevel"])
def test_no_bound_where_it_cannot_be_proven(spoil: str) -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=spoil == "fuse_unk"))
    if spoil == "wordlevel":
        tok = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    tok.add_tokens(["a"])
    if spoil == "nfc":  # composes several characters into one
        tok.normalizer = normalizers.NFC()
    if spoil == "lstrip":  # an added token that swallows the spaces before it
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    if spoil == "whitespace":  # drops the spaces it splits on
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if spoil == "truncation":
        tok.enable_truncation(16)
    assert max_chars_per_token(tok) is None
    assert min_token_count("a" * 10_000, None) == 0
