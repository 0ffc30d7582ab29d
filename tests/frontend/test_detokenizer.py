"""IncrementalDetokenizer against one-shot decode on the bundled byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Text that stresses byte-level BPE: CJK, emoji (4 bytes, ZWJ sequences, flags), combining marks.
_PIECES = st.one_of(
    st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF),
    st.sampled_from(list("🙂👍🏽👨‍👩‍👧🇫🇷€é")),
    st.characters(min_codepoint=0x0300, max_codepoint=0x036F),  # combining marks
    st.characters(min_codepoint=0x20, max_codepoint=0x7E),
    st.sampled_from(["\n", " ", "  ", "\t"]),
)
TEXTS = st.lists(_PIECES, min_size=1, max_size=25).map("".join)


@pytest.fixture(scope="module")
def vocab(smol_tokenizer: Tokenizer) -> dict[str, list[int]]:
    backend = smol_tokenizer.backend
    size = smol_tokenizer.vocab_size
    # Byte-level BPE spells every raw byte as one character: these single-byte tokens let us build
    # any byte sequence, including cut and invalid UTF-8.
    single_byte = [i for i in range(size) if len(backend.id_to_token(i)) == 1]
    return {"all": list(range(size)), "bytes": single_byte, "special": sorted(smol_tokenizer.all_special_ids)}


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool) -> tuple[list[str], str]:
    """Push ids in chunks of the given sizes; return the deltas and the flushed remainder."""
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        size = chunks[k % len(chunks)] if chunks else 1
        deltas.append(detok.push(ids[i : i + size]))
        # Only an unfinished character at the end (a trailing U+FFFD run) is ever held back.
        so_far = tok.decode(ids[: i + size], skip_special_tokens=skip)
        emitted = "".join(deltas)
        assert so_far.startswith(emitted)
        assert emitted.startswith(so_far.rstrip(REPLACEMENT))
        i, k = i + size, k + 1
    assert detok.text == "".join(deltas)
    return deltas, detok.flush()


def _check(tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool) -> None:
    deltas, rest = _stream(tok, ids, chunks, skip)
    reference = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + rest == reference
    # Every U+FFFD we show is one the one-shot decode shows at the same place (the prefix checks in
    # _stream make this hold at every step, not only at the end).
    pos = 0
    for delta in [*deltas, rest]:
        for j, ch in enumerate(delta):
            if ch == REPLACEMENT:
                assert reference[pos + j] == REPLACEMENT
        pos += len(delta)


CHUNKS = st.lists(st.integers(1, 3), min_size=1, max_size=4)


@SETTINGS
@given(text=TEXTS, chunks=CHUNKS, skip=st.booleans())
def test_encoded_text_streams_exactly(
    smol_tokenizer: Tokenizer, text: str, chunks: list[int], skip: bool
) -> None:
    ids = smol_tokenizer.encode(text)
    deltas, rest = _stream(smol_tokenizer, ids, chunks, skip)
    assert rest == ""  # complete characters: nothing is left held at the end
    assert "".join(deltas) == smol_tokenizer.decode(ids, skip_special_tokens=skip)
    assert REPLACEMENT not in "".join(deltas)


@SETTINGS
@given(data=st.data(), chunks=CHUNKS, skip=st.booleans())
def test_random_ids_stream_exactly(
    smol_tokenizer: Tokenizer, vocab: dict[str, list[int]], data: st.DataObject, chunks: list[int], skip: bool
) -> None:
    # Mix whole-vocabulary ids, raw single-byte tokens (cut and invalid UTF-8) and special tokens.
    pools = st.sampled_from(["all", "bytes", "bytes", "special"])
    ids = data.draw(st.lists(pools.flatmap(lambda p: st.sampled_from(vocab[p])), min_size=1, max_size=40))
    _check(smol_tokenizer, ids, chunks, skip)


@SETTINGS
@given(data=st.data(), text=TEXTS, chunks=CHUNKS)
def test_cut_and_spliced_text_streams_exactly(
    smol_tokenizer: Tokenizer, vocab: dict[str, list[int]], data: st.DataObject, text: str, chunks: list[int]
) -> None:
    # Valid text with ids dropped or raw bytes / special tokens inserted: partial characters in the middle.
    ids = smol_tokenizer.encode(text)
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(ids)))
        if ids and data.draw(st.booleans()):
            del ids[min(pos, len(ids) - 1)]
        else:
            ids.insert(pos, data.draw(st.sampled_from(vocab["bytes"] + vocab["special"])))
    if ids:
        _check(smol_tokenizer, ids, chunks, data.draw(st.booleans()))


def test_long_run_of_invalid_bytes_is_released_and_exact(smol_tokenizer: Tokenizer) -> None:
    lead = smol_tokenizer.backend.token_to_id("ä")  # 0xE4 alone: the start of a 3-byte character
    ids = [lead] * 50 + smol_tokenizer.encode("好 ok")
    detok = IncrementalDetokenizer(smol_tokenizer, [], skip_special_tokens=True)
    deltas = [detok.push([t]) for t in ids]
    # Invalid bytes show up while they keep coming (not held to the end), one U+FFFD each.
    assert "".join(deltas[:50]).count(REPLACEMENT) >= 40
    assert "".join(deltas) + detok.flush() == smol_tokenizer.decode(ids)
    assert detok.text.endswith("好 ok")


def test_unfinished_character_at_the_end_is_flushed(smol_tokenizer: Tokenizer) -> None:
    ids = smol_tokenizer.encode("a🙂")[:-1]  # drop the last byte token of the emoji
    ids = ids if smol_tokenizer.decode(ids).endswith(REPLACEMENT) else smol_tokenizer.encode("a🙂")
    detok = IncrementalDetokenizer(smol_tokenizer, [], skip_special_tokens=True)
    shown = "".join(detok.push([t]) for t in ids)
    assert REPLACEMENT not in shown
    assert shown + detok.flush() == smol_tokenizer.decode(ids)


def test_special_tokens_kept_or_skipped(smol_tokenizer: Tokenizer) -> None:
    ids = [1, *smol_tokenizer.encode("hi"), 2, 2, *smol_tokenizer.encode(" there")]
    for skip, expected in ((True, "hi there"), (False, "<|im_start|>hi<|im_end|><|im_end|> there")):
        # spaces_between_special_tokens changes nothing: tokenizers never spaces out added tokens.
        for spaces in (True, False):
            detok = IncrementalDetokenizer(smol_tokenizer, [5, 6], skip, spaces)
            assert "".join(detok.push([t]) for t in ids) == expected == smol_tokenizer.decode(ids, skip)


def test_output_does_not_depend_on_the_prompt(smol_tokenizer: Tokenizer) -> None:
    prompt = smol_tokenizer.encode("The capital of France is")
    out = smol_tokenizer.encode(" Paris.")
    detok = IncrementalDetokenizer(smol_tokenizer, prompt, skip_special_tokens=True)
    assert detok.push(out) == " Paris."


def _sentencepiece_style() -> Tokenizer:
    # Llama-2-style decoder: "▁" is a space and the decoder strips one space at the start of a text, so
    # a token renders differently first; the window must keep left context for that.
    from tokenizers import AddedToken, decoders, models

    vocab = {"<unk>": 0, "▁a": 1, "b": 2, "▁": 3, "▁▁": 4, "c▁": 5}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken("</s>", special=True)])  # id 6
    return Tokenizer(backend, eos_token_ids=[6])


@SETTINGS
@given(ids=st.lists(st.integers(1, 6), min_size=1, max_size=12), chunks=CHUNKS, skip=st.booleans())
def test_sentencepiece_style_decoder_streams_exactly(ids: list[int], chunks: list[int], skip: bool) -> None:
    _check(_sentencepiece_style(), ids, chunks, skip)
