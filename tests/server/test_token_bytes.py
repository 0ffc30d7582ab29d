"""Raw bytes of single tokens (the `bytes` of logprobs), also for tokens that hold part of a character."""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models

from tests.server.fake_server import bundled_tokenizer
from tokenmill.frontend.token_bytes import TokenBytes


def test_byte_level_pieces_concatenate_to_the_utf8():
    tok = bundled_tokenizer()
    to_bytes = TokenBytes(tok.backend)
    for text in ("😀🎉 ok", " 中文 and ü", "\n\t  tabs", "👩‍👩‍👧 family"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(to_bytes(i) for i in ids) == text.encode("utf-8"), text
    partial = tok.encode("😀", add_special_tokens=False)
    assert len(partial) > 1 and b"\xef\xbf\xbd" not in to_bytes(partial[0])  # not U+FFFD
    im_start = tok.backend.token_to_id("<|im_start|>")
    assert to_bytes(im_start) == b"<|im_start|>"


def test_sentencepiece_byte_fallback_pieces():
    vocab = {"<unk>": 0, "<0xF0>": 1, "<0x9F>": 2, "\u2581hi": 3, "there": 4}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["</s>"])
    to_bytes = TokenBytes(backend)
    assert [to_bytes(i) for i in range(5)] == [b"<unk>", b"\xf0", b"\x9f", b" hi", b"there"]
    assert to_bytes(backend.token_to_id("</s>")) == b"</s>"
