"""The embedding routes' tokenization (serving_embedding._tokenize): an input over the context is
passed on whole (to be refused by name), or with `truncate` (Ollama's /api/embed default) cut to it."""

from __future__ import annotations

from tests.server.fake_server import bundled_tokenizer
from tokenmill.entrypoints.openai.serving_embedding import _tokenize


def test_truncate_keeps_each_inputs_first_tokens_up_to_the_context():
    tok = bundled_tokenizer()
    long, short = "the river runs past the mill " * 40, "a short one"
    whole = tok.encode(long)
    assert len(whole) > 64
    ids = _tokenize(tok, [long, short], 64, "input", truncate=True)
    assert ids == [whole[:64], tok.encode(short)]


def test_without_truncate_an_input_keeps_every_token():
    # (and check_embedding_input refuses it with a 400 naming `input`: test_embeddings_server.py)
    tok = bundled_tokenizer()
    long = "the river runs past the mill " * 40
    assert _tokenize(tok, long, 64, "input") == [tok.encode(long)]
